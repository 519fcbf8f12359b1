"""The Tinker-compatible API: wire codec, operations, and routes."""
