"""GPU consumers: the worker that turns requests into token events, and its engines."""
