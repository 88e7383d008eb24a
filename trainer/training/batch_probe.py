"""Find the largest batch size that fits in device memory for one training step.

Doubles the batch size from `start` until a step runs out of memory (or `limit` is reached),
then bisects between the last size that fitted and the first that did not, like Lightning's
BatchSizeFinder ("binsearch") and accelerate's find_executable_batch_size. Each try runs real
forward + backward + AdamW steps under the trial's precision, memory format (--channels-last)
and --compile on random uint8 clips converted on the device, so autocast, GradScaler and the
optimizer state all count.

What is measured is a steady step, the one every step of an epoch repeats, not the first. Each
size runs a warm-up step first: with cudnn.benchmark on (`precision.configure_backends`, as in
training) cuDNN tries its algorithms for every new shape, each with a workspace it sizes from the
memory free at that moment, so on an emptied allocator that first step's reserved peak grows to
nearly the whole device whatever the batch (every size read "tight" and the cap came out low);
under --compile it also compiles. Then the allocator is emptied again (cuDNN keeps the algorithms
it chose, and their workspaces are what later steps allocate) and a second step is measured: its
peak reserved memory is the step's tensors, the chosen algorithms' workspaces and the
allocator's rounding, from a clean allocator. Measuring a steady step, rather than the allocated
peak plus a fixed workspace allowance, needs no guess of how large cuDNN's workspaces are, and
costs one more step per size. In training the first step's trial workspaces come out of memory
that is free then, and cuDNN skips an algorithm whose workspace does not fit, so that step does
not decide what fits either.

Real training holds more than that one step (the next batches in flight, allocator
fragmentation over many steps, other processes' CUDA contexts), so a size counts as fitting
only when its step leaves HEADROOM (10%) of the device's memory free: its allocator's peak
reserved memory stays <= 90% of the total. `probe_batch_size` says how much it used.

CLI: `vidtune batch-probe --model mvit_v2_s --precision auto` (`vidtune.trainer.commands.batch_probe_cli`)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vidtune.trainer.models.registry import (
    build_model,
    check_input_size,
    get_spec,
    maybe_compile,
    prepare_model_memory_format,
)
from vidtune.trainer.training import precision as prec
from vidtune.trainer.training.config import TrainConfig
from vidtune.trainer.training.loop import make_optimizer
from vidtune.trainer.training.precision import is_out_of_memory
from vidtune.trainer.training.run import input_transform

# Runs a step at that batch size and returns the peak share of the device's memory its steady
# step used (None: unknown, e.g. on the CPU); raises torch.OutOfMemoryError when it does not fit.
TryBatch = Callable[[int], float | None]
HEADROOM = 0.10   # share of the device's memory a probed step must leave free (module docstring)


@dataclass(frozen=True)
class BatchProbe:
    """What `probe_batch_size` found."""

    batch_size: int              # the largest size that fits with `headroom` of the memory left free
    headroom: float              # share of the device's memory kept free, in [0, 1)
    peak_share: float | None     # peak share of the memory a step at batch_size used (None: unknown)
    memory_gib: float | None     # the device's memory (None off CUDA)
    tight: int | None = None     # the smallest size that ran but left less than `headroom` free
    share: float = 1.0           # the share of the device a trial gets (--gpus-per-trial 0.5: 0.5)
    gpu: str | None = None       # the GPU it ran on ("NVIDIA H100 80GB HBM3"; None off CUDA)
    settings: str = ""           # what it trained like, e.g. "bf16, channels-last, compiled"

    def describe(self) -> str:
        """One line, e.g. `at most 24 clips per GPU fit with 10% of its 79 GiB kept free (measured on
        NVIDIA H100 80GB HBM3; bf16, channels-last; a steady step of 24 peaks at 84%; 26 ran but
        would leave less)`."""
        memory = f" {self.memory_gib:.0f} GiB" if self.memory_gib is not None else " memory"
        if self.share < 1.0:
            line = (f"at most {self.batch_size} clips per trial fit in {self.share:g} of a GPU's{memory} "
                    f"(--gpus-per-trial) with {self.headroom:.0%} of that kept free")
        else:
            line = (f"at most {self.batch_size} clips per GPU fit with {self.headroom:.0%} of its{memory} "
                    "kept free")
        notes = [f"measured on {self.gpu}"] if self.gpu else []
        if self.settings:
            notes.append(self.settings)
        if self.peak_share is not None:
            notes.append(f"a steady step of {self.batch_size} peaks at {self.peak_share:.0%}")
        if self.tight is not None:
            notes.append(f"{self.tight} ran but would leave less")
        return line + (f" ({'; '.join(notes)})" if notes else "")


def make_step_trial(model_name: str, *, policy: prec.PrecisionPolicy, device: torch.device,
                    num_frames: int, height: int, width: int, channels_last: bool = False,
                    compile: bool = False) -> TryBatch:
    """A `try_batch(b)` running a warm-up step and then the measured, steady step of `model_name`
    on b random clips (module docstring), laid out and compiled as a trial with
    `channels_last` / `compile` trains it (`trainer.training.run.build_run`, `place_model`)."""
    model = prepare_model_memory_format(build_model(model_name), channels_last).to(device)
    model.train()
    # The training run's optimizer and input transform (`trainer.training.run`): their memory counts too.
    defaults = TrainConfig()   # the values do not change the memory a step takes
    optimizer = make_optimizer(model, defaults.lr, defaults.weight_decay, device)
    scaler = policy.make_scaler()
    transform = input_transform(get_spec(model_name), device, train=True, channels_last=channels_last)
    compiled = maybe_compile(model, compile)

    def step(batch_size: int) -> None:
        try:
            clips = torch.randint(0, 256, (batch_size, num_frames, height, width, 3), dtype=torch.uint8,
                                  device=device)
            x = transform(clips)
            labels = torch.randint(0, 2, (batch_size,), device=device)
            with policy.autocast():
                loss = torch.nn.functional.cross_entropy(compiled(x), labels)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            prec.synchronize(device)   # sync point: an asynchronous OOM must surface here
        finally:
            optimizer.zero_grad(set_to_none=True)

    def try_batch(batch_size: int) -> float | None:
        step(batch_size)   # cuDNN's algorithm trials (and compiling) for this shape
        prec.free_memory(device)   # their scratch, sized from free memory, is no step's need
        prec.reset_peak_memory(device)
        step(batch_size)
        return prec.peak_reserved_share(device)

    return try_batch


def find_max_batch_size(model_name: str, *, precision: str = "auto", device: torch.device | str | None = None,
                        num_frames: int | None = None, height: int | None = None, width: int | None = None,
                        start: int = 2, limit: int = 256, try_batch: TryBatch | None = None,
                        headroom: float = HEADROOM, channels_last: bool = False,
                        compile: bool = False) -> int:
    """Largest batch size in [start, limit] whose training step fits in memory on `device` with
    `headroom` of it left free: `probe_batch_size(...).batch_size`."""
    probe = probe_batch_size(model_name, precision=precision, device=device, num_frames=num_frames,
                             height=height, width=width, start=start, limit=limit, try_batch=try_batch,
                             headroom=headroom, channels_last=channels_last, compile=compile)
    return probe.batch_size


def probe_batch_size(model_name: str, *, precision: str = "auto", device: torch.device | str | None = None,
                     num_frames: int | None = None, height: int | None = None, width: int | None = None,
                     start: int = 2, limit: int = 256, try_batch: TryBatch | None = None,
                     headroom: float = HEADROOM, share: float = 1.0, channels_last: bool = False,
                     compile: bool = False) -> BatchProbe:
    """The largest batch size in [start, limit] whose training step fits in memory on `device`
    (default: the first GPU, else the CPU, where the answer is normally `limit`) and leaves
    `headroom` (a share in [0, 1)) of its memory free, with the peak share it used. `share`: the
    part of the device one trial gets (--gpus-per-trial 0.5: two train side by side, each in
    half of the memory), so a step must peak below `share` x (1 - `headroom`) of it.

    `num_frames`/`height`/`width` default to the model's spec; `precision`, `channels_last` and
    `compile` are the trial's (--precision, --channels-last, --compile: each changes what a step
    holds). `try_batch(b)` replaces the real step (tests simulate a memory threshold with it).
    Raises ValueError when even `start` does not fit.
    """
    if start < 1 or limit < start:
        raise ValueError(f"need 1 <= start <= limit, got start={start}, limit={limit}")
    if not 0.0 <= headroom < 1.0:
        raise ValueError(f"headroom must be a share of the memory in [0, 1), got {headroom}")
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be a part of the device in (0, 1], got {share}")
    device = torch.device(device) if device is not None else prec.default_device()
    spec = get_spec(model_name)
    size = (num_frames or spec.num_frames, height or spec.height, width or spec.width)
    check_input_size(model_name, *size)
    policy = prec.choose_precision(precision, device)
    if try_batch is None:
        prec.configure_backends(device)
        try_batch = make_step_trial(model_name, policy=policy, device=device, num_frames=size[0],
                                    height=size[1], width=size[2], channels_last=channels_last,
                                    compile=compile)
    peaks: dict[int, float | None] = {}   # the sizes that fitted, with their peak share
    tight: list[int] = []                 # the sizes that ran but used more than 1 - headroom

    def fits(batch_size: int) -> bool:
        # From a clean allocator: the blocks a larger try reserved stay cached, and a smaller
        # try's peak would then start from theirs (a "tight" 32 made 24 look tight too).
        prec.free_memory(device)
        ok = True
        try:
            peak = try_batch(batch_size)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            ok = False
        if not ok:
            # Outside the except block: until it ends, the traceback's frames hold the step's tensors.
            prec.free_memory(device)
            return False
        if peak is not None and peak > share * (1.0 - headroom):
            tight.append(batch_size)
            return False
        peaks[batch_size] = peak
        return True

    if not fits(start):
        room = "the memory" if share >= 1.0 else f"its {share:g} of the memory"
        problem = (f"leaves less than {headroom:.0%} of {room} free" if tight else "runs out of memory")
        raise ValueError(
            f"even batch size {start} {problem} for {model_name} at {size[0]}x{size[1]}x{size[2]} "
            f"({policy.name}) on {device}; use smaller clips (--num-frames/--height/--width), "
            f"a smaller model, or bf16/fp16 precision")
    good, bad = start, None
    while bad is None and good < limit:
        candidate = min(good * 2, limit)
        if fits(candidate):
            good = candidate
        else:
            bad = candidate
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    settings = [policy.name] + ["channels-last"] * channels_last + ["compiled"] * compile
    return BatchProbe(batch_size=good, headroom=headroom, peak_share=peaks[good],
                      memory_gib=prec.device_memory_gib(device), tight=min(tight) if tight else None,
                      share=share, gpu=prec.device_name(device), settings=", ".join(settings))

