"""A stand-in for nvidia-ml-py's `pynvml` on machines without an NVIDIA GPU: the GPUs a JSON file describes
($FAKE_NVML, else /tmp/fake-nvml.json), read again at every call, so that a test changes a GPU while a run runs.

    {"gpus": [{"pci": "00000000:3B:00.0", "uuid": "GPU-...", "ecc_uncorrected": 0, "ecc_corrected": 0,
               "remap_uncorrectable": 0, "remap_failure": 0, "nvlink": [[0, 0, 0, 0], ...], "lost": false}]}

Only what nodectl's hardware watch (launchers/runctl/hardware.py) calls; a missing file is a node without a
driver (nvmlInit fails, as the real library's does)."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_NVLINK_MAX_LINKS = 18


class NVMLError(Exception):
    pass


class NVMLError_GpuIsLost(NVMLError):  # noqa: N801 - the real library's name
    pass


def _state() -> dict:
    with open(os.environ.get("FAKE_NVML", "/tmp/fake-nvml.json"), encoding="utf-8") as handle:
        return json.load(handle)


def _gpu(handle: int) -> dict:
    gpus = _state()["gpus"]
    if handle >= len(gpus) or gpus[handle].get("lost"):
        raise NVMLError_GpuIsLost("GPU is lost")
    return gpus[handle]


def nvmlInit() -> None:  # noqa: N802
    try:
        _state()
    except OSError:
        raise NVMLError("Driver Not Loaded") from None


def nvmlShutdown() -> None:  # noqa: N802
    pass


def nvmlDeviceGetCount() -> int:  # noqa: N802
    return len(_state()["gpus"])


def nvmlDeviceGetHandleByIndex(index: int) -> int:  # noqa: N802
    _gpu(index)
    return index


def nvmlDeviceGetUUID(handle: int) -> str:  # noqa: N802
    return _gpu(handle).get("uuid", f"GPU-fake-{handle}")


def nvmlDeviceGetPciInfo(handle: int):  # noqa: N802
    return SimpleNamespace(busId=_gpu(handle).get("pci", f"00000000:{handle + 1:02X}:00.0").encode())


def nvmlDeviceGetTotalEccErrors(handle: int, kind: int, counter: int) -> int:  # noqa: N802
    gpu = _gpu(handle)
    return int(gpu.get("ecc_uncorrected" if kind == NVML_MEMORY_ERROR_TYPE_UNCORRECTED else "ecc_corrected", 0))


def nvmlDeviceGetRemappedRows(handle: int) -> tuple:  # noqa: N802
    gpu = _gpu(handle)
    return 0, int(gpu.get("remap_uncorrectable", 0)), 0, int(gpu.get("remap_failure", 0))


def nvmlDeviceGetNvLinkState(handle: int, link: int) -> int:  # noqa: N802
    links = _gpu(handle).get("nvlink") or []
    if link >= len(links):
        raise NVMLError("Not Supported")
    return 1


def nvmlDeviceGetNvLinkErrorCounter(handle: int, link: int, counter: int) -> int:  # noqa: N802
    return int(_gpu(handle)["nvlink"][link][counter])
