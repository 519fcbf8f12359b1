"""twinkle.cli.CLI: twinkle-kit's settings groups from defaults < .env < environment < YAML < flags."""

import pytest

from twinkle.cli import CLI


def test_each_source_overrides_the_one_before(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("TWINKLE_LR", "BATCH_SIZE", "TWINKLE_MODEL_ID"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / ".env").write_text(
        "# defaults for this folder\nexport TWINKLE_MODEL_ID='ms://Qwen/Qwen3.5-4B'\nLR=1e-3\n"
    )
    monkeypatch.setenv("BATCH_SIZE", "16")
    monkeypatch.setenv("TWINKLE_LR", "2e-3")
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "cache"))  # twinkle's own setting, not the script's
    args = CLI.from_args([])
    assert (args.model.model_id, args.optimizer.learning_rate, args.training.batch_size) == (
        "ms://Qwen/Qwen3.5-4B",
        2e-3,
        16,
    )
    pytest.importorskip("yaml")
    (tmp_path / "run.yaml").write_text("lr: 3.0e-3\ntraining:\n  batch_size: 4\ntemplate_model_id: other\n")
    args = CLI.from_args(["--config", "run.yaml", "--batch-size", "2", "--no-enable-liger", "--model-name=twinkle"])
    assert (args.optimizer.learning_rate, args.training.batch_size, args.template.model_id) == (3e-3, 2, "other")
    assert args.model.enable_liger is False and args.extra == {"model_name": "twinkle"}
    assert args.model.model_id == "ms://Qwen/Qwen3.5-4B"  # the primary group: template's model_id stays its own


def test_types_are_cast_and_bad_values_named():
    args = CLI.from_args(
        ["--fsdp-size", "2", "--lora-target-modules", "q_proj,v_proj", "--mode", "ray", "--dp-size", "none"]
    )
    assert (args.infra.fsdp_size, args.infra.mode, args.infra.dp_size) == (2, "ray", None)
    assert args.lora.lora_target_modules == ["q_proj", "v_proj"]
    assert args.get_lora_args() == {
        "target_modules": ["q_proj", "v_proj"],
        "r": 8,
        "lora_alpha": 32,
        "lora_dropout": 0.05,
    }
    assert args.get("fsdp_size") == 2 and args["training"].batch_size == 8
    with pytest.raises(ValueError, match=r"--mode|mode='gpu': expected one of \['local', 'ray'\]"):
        CLI.from_args(["--mode", "gpu"])
    with pytest.raises(ValueError, match="batch-size='eight': expected int"):
        CLI.from_args(["--batch-size", "eight"])
    with pytest.raises(ValueError, match="unexpected argument 'stray'"):
        CLI.from_args(["stray"])
