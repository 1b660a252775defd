"""Print the requirements of pyproject.toml's dependencies and the extras named in argv, one a line
(an extra's "qkmla[...]" expanded), so that .ci/run can install an environment's dependencies
while the checkout is in use and install qkmla itself (editable, --no-deps) only afterwards."""

import sys
import tomllib
from pathlib import Path

project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
extras = project["optional-dependencies"]


def expand(extra: str):
    if extra not in extras:
        raise SystemExit(f"extras: {extra!r} is not one of pyproject.toml's {sorted(extras)}")
    for requirement in extras[extra]:
        if requirement.startswith(project["name"] + "["):
            for inner in requirement[requirement.index("[") + 1:requirement.index("]")].split(","):
                yield from expand(inner.strip())
        else:
            yield requirement


if __name__ == "__main__":
    print("\n".join(dict.fromkeys([*project["dependencies"], *(r for e in sys.argv[1:] for r in expand(e))])))
