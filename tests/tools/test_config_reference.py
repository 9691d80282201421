"""docs/config.md is generated from the config classes: it must be what tools/config_reference.py
writes now, and every field must be explained in its section's docstring (which the page shows)."""
import dataclasses
import re
import subprocess
import sys

from tools.config_reference import ROOT, render


def test_the_page_is_current():
    proc = subprocess.run([sys.executable, "tools/config_reference.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_every_field_is_listed_and_explained():
    from megatron_rl.config.schema import RunConfig

    page = render()
    for section in dataclasses.fields(RunConfig):
        cls = section.default_factory().__class__
        if not dataclasses.is_dataclass(cls):  # a top-level value (plugins), explained by RunConfig
            assert f"| `{section.name}` |" in page
            assert re.search(rf"\b{re.escape(section.name)}:", RunConfig.__doc__ or ""), f"{section.name} has no words"
            continue
        for f in dataclasses.fields(cls):
            if section.name == "rollout" and f.name == "engines":  # each registered engine's section instead
                from megatron_rl.rollout import ENGINES

                for engine in ENGINES.names():
                    settings = ENGINES.get(engine).settings
                    if settings is not None:
                        assert f"## rollout.{engine}" in page
                        assert all(f"| `rollout.{engine}.{g.name}` |" in page for g in dataclasses.fields(settings))
                continue
            assert f"| `{section.name}.{f.name}` |" in page
            assert re.search(rf"\b{re.escape(f.name)}\b", cls.__doc__ or ""), f"{section.name}.{f.name} has no words"
