"""What ``python -m reffsdp.swap`` rebinds: the public names of ``torch.distributed.fsdp``
and the modules trainers import them from become reffsdp's, in the process it runs the
program in (checked in a fresh interpreter: the swap is for good)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent(
    """
    import sys
    import reffsdp, reffsdp.wrap
    import torch.distributed.fsdp as fsdp
    from torch.distributed._composable.fsdp import fully_shard as composable_fully_shard
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.api import MixedPrecision
    from torch.distributed.fsdp.fully_sharded_data_parallel import OptimStateKeyType
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

    assert FSDPModule is reffsdp.FSDPModule and fsdp.fully_shard is reffsdp.fully_shard
    assert composable_fully_shard is reffsdp.fully_shard
    assert FullyShardedDataParallel is reffsdp.FullyShardedDataParallel
    assert ShardingStrategy is reffsdp.ShardingStrategy and MixedPrecision is reffsdp.MixedPrecision
    assert OptimStateKeyType is reffsdp.OptimStateKeyType
    assert ShardedGradScaler.__module__.startswith("reffsdp"), ShardedGradScaler
    assert ModuleWrapPolicy is reffsdp.wrap.ModuleWrapPolicy
    assert transformer_auto_wrap_policy is reffsdp.wrap.transformer_auto_wrap_policy
    assert fsdp.FlatParameter is reffsdp.FlatParameter
    print("args", sys.argv[1:], __name__)
    """
)


def _swap(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "reffsdp.swap", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )


def test_the_program_sees_reffsdps_objects_under_torchs_names(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(PROGRAM)
    result = _swap(str(script), "--lr", "0.1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "args ['--lr', '0.1'] __main__"
    assert result.stderr.count("reffsdp.swap: ") == 1
    assert "torch.distributed.fsdp.wrap" in result.stderr and "whole process" in result.stderr


def test_without_a_program_the_usage_is_shown():
    result = _swap()
    assert result.returncode == 1
    assert "usage: python -m reffsdp.swap (SCRIPT | -m MODULE) [ARGS ...]" in result.stderr
    assert "no such script 'missing.py'" in _swap("missing.py").stderr
