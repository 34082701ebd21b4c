"""`arslice train`'s settings (`TrainConfig`) and what may change between a run and its resume."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

from ar_slicing.machinery.layout import TRAIN_STATE_DIR
from pipeline.architectures import TRAIN_ARCHITECTURES, described

log = logging.getLogger(__name__)


# `--arch`'s choices: pipeline/architectures.py (the one table the trainer and mqar read)
ARCHITECTURES = TRAIN_ARCHITECTURES
STATE_DIR = TRAIN_STATE_DIR
# Fields that change how a run is executed or reported but not what it computes, so a run may
# be resumed after changing them.
_RESUMABLE_CHANGES = {
    "overwrite",
    "device",
    "threads",
    "checkpoint_every",
    "eval_every",
    "progress",
    "prebuilt",  # (where the same model may be taken from instead: `pipeline.train.prebuilt`)
    "train_here_until",  # (which of its kept checkpoints are trained here when it is taken)
}


@dataclass(frozen=True)
class Recipe:
    """The one training recipe: AdamW (beta1 0.9, `beta2`, `weight_decay` on matrices only), the
    rate warmed up linearly over `warmup_steps` and decayed by a cosine to `lr * min_lr_ratio` at
    `steps`, gradient norms clipped at `grad_clip` (0: never). `arslice train` trains by it with
    its settings (`TrainConfig.recipe`), the MQAR probe with its own rates and lengths
    (`pipeline.mqar`), both through `pipeline.train.loop.recipe_steps`."""

    lr: float = 3e-3
    steps: int = 1000
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta2: float = 0.95
    grad_clip: float = 1.0


RECIPE = Recipe()  # (its defaults are `arslice train`'s)


@dataclass(frozen=True)
class TrainConfig:
    arch: str = field(
        metadata={
            "help": "sequence mixer of the model: " + described(TRAIN_ARCHITECTURES),
            "choices": ARCHITECTURES,
        }
    )
    tokens: str = field(metadata={"help": "training token store directory"})
    out: str = field(metadata={"help": "output directory (native checkpoint + meta.json)"})
    val_tokens: str | None = field(
        default=None, metadata={"help": "held-out token store for the periodic validation loss"}
    )
    d_model: int = field(default=128, metadata={"help": "model width"})
    n_layers: int = field(default=4, metadata={"help": "number of blocks"})
    model_options: list[str] = field(
        default_factory=list,
        metadata={
            "help": "further ModelConfig fields as KEY=VALUE (VALUE parsed as JSON), "
            'e.g. state_mixer_kwargs={"hidden_mult": 2}'
        },
    )
    mixer_options: list[str] = field(
        default_factory=list,
        metadata={
            "help": "sequence-mixer options as KEY=VALUE, e.g. num_heads=4 (attention) or "
            "kernel_size=3 (base_conv); an option the mixer does not have is refused"
        },
    )
    seq_len: int = field(
        default=256, metadata={"help": "training sequence length (tokens per row)"}
    )
    batch_size: int = field(default=16, metadata={"help": "rows per optimizer step"})
    steps: int = field(default=RECIPE.steps, metadata={"help": "optimizer steps"})
    lr: float = field(default=RECIPE.lr, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(
        default=RECIPE.min_lr_ratio,
        metadata={"help": "final learning rate as a fraction of the peak (cosine floor)"},
    )
    warmup_steps: int = field(default=RECIPE.warmup_steps, metadata={"help": "linear warmup steps"})
    weight_decay: float = field(
        default=RECIPE.weight_decay, metadata={"help": "AdamW weight decay (matrices only)"}
    )
    beta2: float = field(default=RECIPE.beta2, metadata={"help": "AdamW beta2 (beta1 is 0.9)"})
    grad_clip: float = field(
        default=RECIPE.grad_clip, metadata={"help": "gradient-norm clip (0 disables)"}
    )
    seed: int = field(
        default=0, metadata={"help": "seed of the initialisation and the batch order"}
    )
    eval_every: int = field(
        default=200, metadata={"help": "validation loss every N steps (0: only at the end)"}
    )
    eval_batches: int = field(default=8, metadata={"help": "batches in each validation estimate"})
    checkpoint_every: int = field(
        default=200, metadata={"help": "save a resumable checkpoint every N steps (0: never)"}
    )
    keep_checkpoints: list[int] = field(
        default_factory=list,
        metadata={
            "help": "steps whose model to keep as OUT/checkpoints/step-<n>/ (a native checkpoint "
            "each, `native:OUT/checkpoints/step-<n>`), before the last step; the final model is "
            "OUT itself. 0 keeps the initial weights"
        },
    )
    saved_dtype: str = field(
        default="fp32",
        metadata={
            "help": "precision of the saved weights (the final model and kept checkpoints): fp32 "
            "as trained; bf16 rounds every parameter to bf16, still written as fp32: what a "
            "folder of prebuilt models stores, so a model trained here and one taken from the "
            "folder are the same weights",
            "choices": ["fp32", "bf16"],
        },
    )
    prebuilt: str | None = field(
        default=None,
        metadata={
            "help": "folder of prebuilt models (`arslice export-models`, `make demo-models`): "
            "OUT's model is taken from FOLDER/<OUT's name>/ instead of trained, when it was made "
            "with the same settings from the same token streams; otherwise refused, naming what "
            "differs"
        },
    )
    train_here_until: int = field(
        default=0,
        metadata={
            "help": "with --prebuilt: the kept checkpoints up to this step are trained here, as "
            "the first steps of the same run (the same seed, batches and schedule, so the same "
            "weights), and only the later ones and the final model are taken from the folder "
            "(which then holds only those): a small folder keeps the early points of the recall "
            "emergence. 0: every kept checkpoint from the folder"
        },
    )
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N or auto"})
    dtype: str = field(
        default="auto",
        metadata={
            "help": "autocast dtype of the forward and backward passes; auto = bf16 on CUDA GPUs "
            "that have it, else fp32 (also on every CPU, so weights do not depend on the CPU)",
            "choices": ["auto", "bf16", "fp32"],
        },
    )
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    overwrite: bool = field(default=False, metadata={"help": "retrain even if OUT is complete"})

    @property
    def recipe(self) -> Recipe:
        """The run's training recipe (its rates, steps and optimizer settings)."""
        return Recipe(**{f.name: getattr(self, f.name) for f in fields(Recipe)})
