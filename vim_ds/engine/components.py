"""Where a run's parsed options become the configs of the layers below the engine: the one place the argparse
namespace crosses into vim_ds.data (and the data naming of vim_ds.checkpoint) and vim_ds.models. Each function
takes `args` as `run_options.parse_args` returns them and fills every field of one config; the library below never
sees the namespace, and a default lives only in the parser."""
from __future__ import annotations

from ..data.datasets import DatasetConfig
from ..data.loader import LoaderConfig
from ..data.mixup import MixupConfig
from ..data.transforms import TransformConfig
from ..models import ModelConfig


def transform_config(args) -> TransformConfig:
    return TransformConfig(input_size=args.input_size, eval_crop_ratio=args.eval_crop_ratio,
                           scale=tuple(args.scale), ratio=tuple(args.ratio), hflip=args.hflip, aa=args.aa,
                           color_jitter=args.color_jitter, train_interpolation=args.train_interpolation,
                           reprob=args.reprob, remode=args.remode, recount=args.recount)


def dataset_config(args) -> DatasetConfig:
    return DatasetConfig(data_set=args.data_set, data_path=args.data_path, nb_classes=args.nb_classes,
                         synthetic_size=args.synthetic_size, seed=args.seed, transform=transform_config(args))


def loader_config(args) -> LoaderConfig:
    return LoaderConfig(num_workers=args.num_workers, data_timeout=args.data_timeout)


def mixup_config(args) -> MixupConfig:
    return MixupConfig(mixup=args.mixup, cutmix=args.cutmix, cutmix_minmax=args.cutmix_minmax,
                       mixup_prob=args.mixup_prob, mixup_switch_prob=args.mixup_switch_prob,
                       mixup_mode=args.mixup_mode, smoothing=args.smoothing)


def model_config(args, num_classes: int) -> ModelConfig:
    """The model the options describe, with `num_classes` from the data."""
    return ModelConfig(args.model, num_classes, args.input_size, dict(args.model_kwargs), drop=args.drop,
                       drop_path=args.drop_path, grad_checkpointing=args.grad_checkpointing)
