"""twinkle-kit's `twinkle.server` import path, for what its client scripts import from it
(`twinkle.server.common.input_feature_to_datum`). Our server itself is `twinkle.serve`."""
