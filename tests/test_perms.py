"""What we write gets the user's umask, as any file they create would."""

import os
import stat

import pytest


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_safetensors_files_get_the_umask(tmp_path, umask_022):
    import torch
    from safetensors.torch import save_file

    from tuneledger.perms import apply_umask

    (tmp_path / "sub").mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "sub" / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    apply_umask(tmp_path)
    assert stat.S_IMODE((tmp_path / "sub" / "model.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "config.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "sub").stat().st_mode) == 0o755


def test_a_private_umask_stays_private(tmp_path):
    from tuneledger.perms import apply_umask

    (tmp_path / "f").write_text("x")
    old = os.umask(0o077)
    try:
        apply_umask(tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "f").stat().st_mode) == 0o600


def test_a_cpu_run_lists_no_cuda_version():
    from tuneledger.machine_facts import versions

    assert "cuda" not in versions(cpu=True) and versions(cpu=True)["torch"]
