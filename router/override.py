"""Per-request overrides, strongest first: the `X-Tierserve-Tier` header, then the model name
(`full`, `highspeed` or a tier's upstream name; `auto` leaves it to the router), then
OpenAI's `reasoning_effort` (`low` -> highspeed, `high` -> full, `medium` -> the router)."""

from collections.abc import Mapping

from router.policy import TIERS, Decision, Tier

AUTO_MODEL = "auto"
TIER_HEADER = "x-tierserve-tier"
_EFFORT_TIERS: dict[str, Tier] = {"low": "highspeed", "high": "full"}


class OverrideError(ValueError):
    def __init__(self, message: str, param: str, not_found: bool = False) -> None:
        super().__init__(message)
        self.param = param
        self.not_found = not_found


def override(
    header: str | None,
    model: str | None,
    reasoning_effort: str | None,
    model_tiers: Mapping[str, Tier],
) -> Decision | None:
    """The forced decision, or None when the router decides. `model_tiers` maps every model
    name a client may ask for (tier names and upstream names) to its tier."""
    if header is not None:
        tier = header.strip().lower()
        if tier not in TIERS:
            raise OverrideError(
                f"X-Tierserve-Tier must be one of {', '.join(TIERS)}, got {header!r}", "header"
            )
        return Decision(tier, "override", "header")  # type: ignore[arg-type]
    if model is not None and model != AUTO_MODEL:
        if model not in model_tiers:
            names = ", ".join([AUTO_MODEL, *sorted(model_tiers)])
            raise OverrideError(
                f"The model `{model}` does not exist; use one of: {names}.", "model", True
            )
        return Decision(model_tiers[model], "override", "model")
    if reasoning_effort in _EFFORT_TIERS:
        return Decision(_EFFORT_TIERS[reasoning_effort], "override", "reasoning_effort")
    return None
