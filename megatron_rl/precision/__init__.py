"""Named precision recipes for the trainer and the rollout engine together (recipes.py)."""
from megatron_rl.precision.recipes import PRECISION_RECIPES, PrecisionRecipe, expand_precision

__all__ = ["PRECISION_RECIPES", "PrecisionRecipe", "expand_precision"]
