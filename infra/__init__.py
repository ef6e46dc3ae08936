"""The embedded dev stack, the `tokenbus` CLI, and deployment files."""
