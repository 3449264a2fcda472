"""Tier ``tokens``: the ``exact`` tier with a tolerance - the cache stored as its tokens, and a residual only
where regeneration is off by more than ``tolerance`` (``None``: no residual at all; restore = recompute)."""

from __future__ import annotations

from ..errors import ConfigError
from ..registry import register_tier
from .base import UNSET, Options
from .exact import ExactTier


@register_tier
class TokensTier(ExactTier):
    tier_id = "tokens"
    summary = "tokens only, or within a tolerance; the model recomputes the cache"

    def tolerance(self, opts: Options):
        """None (default): no residual; eps >= 0: every component within eps of the original."""
        tol = None if opts.tolerance is UNSET else opts.tolerance
        if tol is not None and not (isinstance(tol, (int, float)) and not isinstance(tol, bool) and tol >= 0):
            raise ConfigError("tolerance must be None or a number >= 0")
        return tol
