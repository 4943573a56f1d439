"""Test-session configuration shared by every test under ``tests/``.

* ``--device {cpu,cuda}`` picks the device the harnesses run on (default: cpu). It is
  exported as ``REFFSDP_TEST_DEVICE`` so spawned rank processes see the same choice.
* Tests marked ``gpu`` are skipped, with the reason, when CUDA is absent or has fewer
  devices than the test's ``gpu(min_devices=N)`` marker asks for.
"""

import os

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        choices=("cpu", "cuda"),
        default=os.environ.get("REFFSDP_TEST_DEVICE", "cpu"),
        help="device the distributed harnesses run on (default: cpu)",
    )


def pytest_configure(config):
    device = config.getoption("--device")
    if device == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda was given but CUDA is not available")
    os.environ["REFFSDP_TEST_DEVICE"] = device


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = marker.kwargs.get("min_devices", 1)
        if not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs CUDA, which is not available"))
        elif torch.cuda.device_count() < needed:
            reason = f"needs {needed} CUDA devices, found {torch.cuda.device_count()}"
            item.add_marker(pytest.mark.skip(reason=reason))
