"""Finding Focus adapters shared on the Hub (`search_adapters`): the Hub's own filters, each card's headline figures.

The Hub tags every model whose card names a base model with ``base_model:<relation>:<id>``, and focus_hf's cards carry
the ``focus-hf`` tag and their headline figures under the ``focus_hf`` metadata key (`focus_hf.hub.eval_results
.headline`): one listing request (``list_models`` with both tags as filters and the card data) finds them all.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from focus_hf.hub.repo_ids import validate_repo_id

SEARCH_TAG = "focus-hf"
HEADLINE_KEY = "focus_hf"


@dataclasses.dataclass(frozen=True)
class SharedAdapter:
    """A Focus adapter found on the Hub and the figures its card gives (None where it gives none)."""

    repo_id: str
    last_modified: Optional[str]
    num_groups: Optional[int] = None
    top_k: Optional[int] = None
    window: Optional[int] = None
    perplexity_ratio: Optional[float] = None
    speedup: Optional[float] = None
    context_length: Optional[int] = None
    version: Optional[str] = None


def _number(value: Any, kind: type) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return kind(value)


def search_adapters(base_model: str, *, limit: int = 50, token: str | bool | None = None) -> list[SharedAdapter]:
    """The Focus adapters on the Hub whose card names `base_model` as the base they adapt, newest first, with the
    headline figures of each card.

    Raises:
        [`InvalidRepoIdError`]: `base_model` is not a Hub id.
        huggingface_hub.errors: the listing failed.
    """
    from huggingface_hub import HfApi

    base_model = validate_repo_id(base_model)
    found = []
    models = HfApi(token=token).list_models(
        filter=[SEARCH_TAG, f"base_model:adapter:{base_model}"], cardData=True, limit=limit, sort="last_modified"
    )
    for info in models:
        card = info.card_data.to_dict() if info.card_data is not None else {}
        figures = card.get(HEADLINE_KEY) if isinstance(card.get(HEADLINE_KEY), dict) else {}
        found.append(
            SharedAdapter(
                repo_id=info.id,
                last_modified=info.last_modified.isoformat() if info.last_modified else None,
                num_groups=_number(figures.get("num_groups"), int),
                top_k=_number(figures.get("top_k"), int),
                window=_number(figures.get("window"), int),
                perplexity_ratio=_number(figures.get("perplexity_ratio"), float),
                speedup=_number(figures.get("speedup"), float),
                context_length=_number(figures.get("context_length"), int),
                version=str(figures["version"]) if figures.get("version") else None,
            )
        )
    return found
