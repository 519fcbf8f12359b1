"""twinkle.utils: twinkle-kit's import path for device probes its scripts call (`twinkle.utils.framework`)."""
