"""The shipped recipes and card template are found installed, editable, and from a plain checkout."""

import subprocess
import sys
from pathlib import Path

from hf_lowprec.assets import CHECKOUT, shipped_folder

ROOT = Path(__file__).resolve().parent.parent

# Python started in the repository root, with the editable install's import hook removed: the source tree alone
PLAIN_CHECKOUT = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "").lower()]  # the finder is a class
from hf_lowprec.recipe import load_recipe, list_recipes
from hf_lowprec.assets import shipped_folder
import hf_lowprec
assert hf_lowprec.__file__.startswith({root!r}), hf_lowprec.__file__
print(load_recipe("fp8-train").name, len(list_recipes()), shipped_folder("model_cards").joinpath("model_card.md.jinja").is_file())
"""


def test_recipes_and_card_template_load_from_a_plain_checkout():
    proc = subprocess.run([sys.executable, "-c", PLAIN_CHECKOUT.format(root=str(ROOT))], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["fp8-train", str(len(list(ROOT.glob("recipes/*.yaml")))), "True"]


def test_shipped_folders_hold_the_repository_files():
    names = sorted(p.name for p in shipped_folder("recipes").iterdir() if p.name.endswith(".yaml"))
    assert names == sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")) and CHECKOUT == ROOT
    assert shipped_folder("model_cards").joinpath("model_card.md.jinja").read_text() == (ROOT / "model_cards" / "model_card.md.jinja").read_text()


def test_the_wheel_lists_every_package_of_the_source_tree():
    import re

    block = re.search(r"^packages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.S | re.M).group(1)
    listed = set(re.findall(r'"([\w.]+)"', block))
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "hf_lowprec").rglob("__init__.py")}
    assert found <= listed, f"missing from pyproject.toml packages: {sorted(found - listed)}"
