"""Where a run's options become the configs of the layers below the engine: the one place the run's RunConfig
(config/run_config.py) crosses into vim_ds.data (and the data naming of vim_ds.checkpoint) and vim_ds.models. Each
function takes the RunConfig and fills every field of one config; the library below never sees the run's options,
and a default lives only in the options' definitions."""
from __future__ import annotations

from ..data.datasets import DatasetConfig
from ..data.loader import LoaderConfig
from ..data.mixup import MixupConfig
from ..data.transforms import TransformConfig
from ..models import ModelConfig
from .run_config import RunConfig


def transform_config(config: RunConfig) -> TransformConfig:
    model, augment = config.model, config.augment
    return TransformConfig(input_size=model.input_size, eval_crop_ratio=config.data.eval_crop_ratio,
                           scale=tuple(augment.scale), ratio=tuple(augment.ratio), hflip=augment.hflip,
                           aa=augment.aa, color_jitter=augment.color_jitter,
                           train_interpolation=augment.train_interpolation, reprob=augment.reprob,
                           remode=augment.remode, recount=augment.recount)


def dataset_config(config: RunConfig) -> DatasetConfig:
    data = config.data
    return DatasetConfig(data_set=data.data_set, data_path=data.data_path, nb_classes=data.nb_classes,
                         synthetic_size=data.synthetic_size, seed=config.run.seed,
                         transform=transform_config(config))


def loader_config(config: RunConfig) -> LoaderConfig:
    return LoaderConfig(num_workers=config.data.num_workers, data_timeout=config.data.data_timeout)


def mixup_config(config: RunConfig) -> MixupConfig:
    augment = config.augment
    # a list, as argparse gives it to the published main.py's Mixup
    minmax = None if augment.cutmix_minmax is None else list(augment.cutmix_minmax)
    return MixupConfig(mixup=augment.mixup, cutmix=augment.cutmix, cutmix_minmax=minmax,
                       mixup_prob=augment.mixup_prob, mixup_switch_prob=augment.mixup_switch_prob,
                       mixup_mode=augment.mixup_mode, smoothing=augment.smoothing)


def model_config(config: RunConfig, num_classes: int) -> ModelConfig:
    """The model the options describe, with `num_classes` from the data."""
    model = config.model
    return ModelConfig(model.model, num_classes, model.input_size, dict(model.model_kwargs), drop=model.drop,
                       drop_path=model.drop_path, grad_checkpointing=model.grad_checkpointing)
