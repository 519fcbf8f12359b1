"""twinkle.advantage."""
