"""Language models: the mixers (models/mixers/), the LM backbone and the checkpoint formats
(models/checkpoints/), one file each.

`load_model(spec, device="cpu", dtype=None) -> LoadedModel` and
`models.nll.per_token_nll(loaded, input_ids, targets)` are what the eval stage uses;
`models.backbone.LanguageModel(ModelConfig(...))` and `models.checkpoints.native.save_native`
what the trainer uses.
"""

from models.checkpoints.registry import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
