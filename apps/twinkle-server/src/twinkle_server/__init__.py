"""twinkle_server."""
