"""Where the repository's bundled files are (the product works from its own repository alone)."""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIGS_DIR = REPO_ROOT / "configs"
PROFILES_DIR = CONFIGS_DIR / "profiles"
SCENARIOS_DIR = CONFIGS_DIR / "scenarios"
DATA_DIR = REPO_ROOT / "data"
