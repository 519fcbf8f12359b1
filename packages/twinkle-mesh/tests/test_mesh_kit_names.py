"""twinkle-kit's spellings on the mesh layer: DeviceGroup(device_type='GPU' / 'CPU'), get_logger()."""

import logging

import pytest

from twinkle.mesh import DeviceGroup, get_logger


@pytest.mark.parametrize("given, kept", [("GPU", "cuda"), ("gpu", "cuda"), ("CPU", "cpu"), ("cuda", "cuda")])
def test_device_type_spellings(given, kept):
    assert DeviceGroup("model", 2, given).device_type == kept


def test_an_unknown_device_type_is_refused_by_name():
    with pytest.raises(ValueError, match=r"device_type 'npu' is not one of \('cpu', 'cuda'\)"):
        DeviceGroup("model", 2, "npu")


def test_get_logger_prints_on_local_rank_zero_only(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("LOCAL_RANK", "0")
    log = get_logger(log_file=str(tmp_path / "run.log"))
    assert log.name == "twinkle" and log.level == logging.INFO
    log.info("step 1 loss 2.5")
    assert "step 1 loss 2.5" in capsys.readouterr().err
    assert "step 1 loss 2.5" in (tmp_path / "run.log").read_text()
    monkeypatch.setenv("LOCAL_RANK", "1")
    get_logger().info("from rank one")
    assert "from rank one" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown log level 'LOUD'"):
        get_logger(log_level="LOUD")
    for handler in [h for h in log.handlers if isinstance(h, logging.FileHandler)]:
        log.removeHandler(handler)
        handler.close()
