"""The torchtitan releases this integration supports, checked once before anything of torchtitan's
is imported, so that another release is refused with one line instead of failing inside an override.

The override contract is torchtitan's ``Configurable.Config`` fields of the targets (DeepSeek-V3's
``Attention.Config``, ``FlexAttention.Config``, ``OptimizersContainer.Config``,
``MetricsProcessor.Config``), which torchtitan may change between releases (its overrides README,
"Version compatibility"): the range is the releases tested, both ends in CI.
"""

from __future__ import annotations

from importlib import metadata

LOWEST, BELOW = (0, 3, 0), (0, 4, 0)
SUPPORTED = ">=0.3.0,<0.4"


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def check_torchtitan(version: str | None = None) -> str:
    """The installed torchtitan's version if this integration supports it; ImportError naming the
    supported range otherwise (or when torchtitan is missing)."""
    if version is None:
        try:
            version = metadata.version("torchtitan")
        except metadata.PackageNotFoundError:
            raise ImportError(f"qkmla.integrations.torchtitan needs torchtitan{SUPPORTED} (Python >= 3.11): "
                              "pip install 'qkmla[torchtitan]'") from None
    if not LOWEST <= _release(version) < BELOW:
        raise ImportError(f"qkmla.integrations.torchtitan supports torchtitan{SUPPORTED}, found {version}; "
                          f"pip install 'qkmla[torchtitan]'")
    return version
