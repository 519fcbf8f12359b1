# LoRA SFT under torchrun with FSDP2 x DP, settings from twinkle.cli, checkpoints that resume, in the
# shape of twinkle-kit's cookbook/transformers/fsdp2.py (written for this suite).
import os
from pathlib import Path

from peft import LoraConfig
from torch.optim import Muon
from tqdm import tqdm

import twinkle
from twinkle import DeviceMesh, get_device_placement, get_logger
from twinkle.cli import CLI
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.kernel import kernelize, liger_builtin, npu_builtin
from twinkle.model import TransformersModel
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.utils.framework import Torch

logger = get_logger()
args = CLI.from_args()
device_mesh = DeviceMesh.from_sizes(fsdp_size=args.infra.fsdp_size, dp_size=args.infra.dp_size)
twinkle.initialize(mode=args.infra.mode, global_device_mesh=device_mesh)


def build_dataset(num_samples):
    dataset = Dataset(dataset_meta=DatasetMeta(args.dataset.dataset_id, data_slice=range(num_samples)))
    dataset.set_template(args.template.template_cls, model_id=args.model.model_id,
                         max_length=args.template.max_length, truncation_strategy=args.template.truncation_strategy)
    dataset.map(SelfCognitionProcessor(args.extra.get('model_name', 'twinkle大模型'),
                                       args.extra.get('model_author', 'ModelScope社区')))
    dataset.encode()
    return dataset


def save_checkpoint(model, name, dataloader):
    model.save(name, output_dir=args.training.output_dir, adapter_name=args.lora.adapter_name, save_optimizer=True,
               consumed_train_samples=dataloader.get_state()['consumed_train_samples'])


def evaluate(model):
    dataloader = DataLoader(dataset=build_dataset(args.training.eval_samples or 100), batch_size=args.training.batch_size)
    for batch in tqdm(dataloader):
        model.forward_only(inputs=batch)
        model.calculate_loss()
    return model.calculate_metric(is_training=False)


def train():
    dataloader = DataLoader(dataset=build_dataset(args.training.train_samples or 1000), batch_size=args.training.batch_size)
    model = TransformersModel(model_id=args.model.model_id)
    layers = {type(m).__name__ for m in model.model.modules() if type(m).__name__.endswith('DecoderLayer')}
    model.model._no_split_modules = list(layers)
    kernel_mapping = {}
    baseline = os.environ.get('TWINKLE_TORCH_BASELINE', '').lower() in ('1', 'true', 'yes')
    if Torch.is_npu_available() and not baseline:
        kernel_mapping.update(npu_builtin(model))
    if args.model.enable_liger and not baseline:
        kernel_mapping.update(liger_builtin(model))
    if kernel_mapping:
        model = kernelize(model, kernel_mapping)
    task = 'fused_lm_ce' if args.model.enable_liger and args.model.enable_fused_ce else 'causal_lm'
    model.add_adapter_to_model(args.lora.adapter_name, LoraConfig(**args.get_lora_args()),
                               gradient_accumulation_steps=args.training.gradient_accumulation_steps)
    model.set_optimizer(optimizer_cls=Muon, lr=args.optimizer.learning_rate, adjust_lr_fn='match_rms_adamw')
    model.set_lr_scheduler(scheduler_cls=args.scheduler.scheduler_cls, num_warmup_steps=args.scheduler.num_warmup_steps,
                           num_training_steps=len(dataloader))
    if args.training.resume_from_checkpoint:
        progress = model.resume_from_checkpoint(str(Path(args.training.resume_from_checkpoint).resolve()),
                                                resume_only_model=args.training.resume_only_model,
                                                adapter_name=args.lora.adapter_name)
        if not args.training.ignore_data_skip:
            dataloader.resume_from_checkpoint(progress['consumed_train_samples'])
    logger.info(get_device_placement())
    logger.info(model.get_train_configs())
    optimizer_group = model.optimizer_group[args.lora.adapter_name]
    best_loss, eval_interval = float('inf'), args.training.eval_interval or 40
    for batch in dataloader:
        model.forward_backward(inputs=batch, task=task)
        model.clip_grad_and_step()
        cur_step = optimizer_group.cur_step
        if cur_step % args.training.log_interval == 0:
            logger.info(f'step {cur_step} of {len(dataloader)}, metric: {model.calculate_metric(is_training=True)}')
        if cur_step > 0 and cur_step % eval_interval == 0:
            metrics = evaluate(model)
            logger.info(f'Eval metric: {metrics}')
            if float(metrics['loss']) < best_loss:
                save_checkpoint(model, f'checkpoint-{cur_step}', dataloader)
                best_loss = float(metrics['loss'])
    save_checkpoint(model, 'last-checkpoint', dataloader)


if __name__ == '__main__':
    train()
