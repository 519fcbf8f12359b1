"""twinkle.preprocessor."""
