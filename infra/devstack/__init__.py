"""The embedded development stack on one machine: broker, Redis, GPU consumer, stream
processors and edge as local processes, bound to 127.0.0.1."""
