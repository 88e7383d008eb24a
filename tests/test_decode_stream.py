"""JPEG frames decoded on a GPU (datasets/decode.py, `_decode_on_own_stream`): on a stream of their
own, which is drained before each decode (nvJPEG must not be handed memory that queued kernels
still read) while the training stream is never synchronised, only ordered after the decode; and
the training loop counts that decode as time waiting for data, not as step time. No GPU here:
torch's streams and torchvision's decoder are faked and every call recorded."""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torchvision.io import encode_jpeg

from vidtune.datasets import decode
from vidtune.datasets.video import clips_to_device
from vidtune.trainer.training import loop
from vidtune.trainer.training.precision import choose_precision


def _jpegs(n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 255, (n, 16, 16, 3), dtype=torch.uint8, generator=g)
    return [encode_jpeg(f.permute(2, 0, 1).contiguous(), quality=95) for f in frames]


def _fake_cuda(monkeypatch) -> list[tuple]:
    """Fakes of the training (current) stream, the decoding stream, full synchronisation and
    the decoder; returns the list of calls they record, in order."""
    calls: list[tuple] = []

    class Stream:
        def __init__(self, name: str):
            self.name = name

        def synchronize(self):
            calls.append(("synchronize", self.name))

        def wait_stream(self, other):
            calls.append(("wait_stream", self.name, other.name))

        def __enter__(self):
            now.append(self)

        def __exit__(self, *exc):
            now.pop()

    training = Stream("training")
    now = [training]
    cpu_decode = decode.decode_jpeg

    def fake_decode(jpegs, *, device):
        calls.append(("decode_jpeg", now[-1].name, torch.device(device)))
        return cpu_decode(jpegs)            # frames as the GPU would give them, on the CPU

    monkeypatch.setattr(decode, "_DECODE_STREAMS", {}, raising=False)   # absent before it had one
    monkeypatch.setattr(torch, "Stream", lambda device: Stream(f"decoding {device}"))
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: now[-1])
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda t, stream: calls.append(("record_stream", stream.name)))
    for module in (torch.cuda, torch.accelerator):
        monkeypatch.setattr(module, "synchronize", lambda device=None: calls.append(("full synchronize",)))
    monkeypatch.setattr(decode, "decode_jpeg", fake_decode)
    return calls


def test_a_gpu_decode_drains_its_own_stream_and_never_the_training_one(monkeypatch):
    calls = _fake_cuda(monkeypatch)
    jpegs = _jpegs()
    gpu = torch.device("cuda", 1)
    out = clips_to_device([jpegs, jpegs[::-1]], gpu)
    second = clips_to_device([jpegs], gpu)
    one_batch = [("synchronize", "decoding cuda:1"),             # the last decode's copy, no training kernel
                 ("decode_jpeg", "decoding cuda:1", gpu),        # its output taken from that stream's blocks
                 ("wait_stream", "training", "decoding cuda:1"),  # training kernels after it, no host wait
                 ("record_stream", "training")]                  # its block kept until they have read it
    assert calls == one_batch * 2                                # per batch; one stream made, for that GPU
    assert ("synchronize", "training") not in calls and ("full synchronize",) not in calls
    assert out.shape == (2, 4, 16, 16, 3) and torch.equal(out[1], out[0].flip(0))
    assert torch.equal(second[0], out[0])
    calls.clear()
    clips_to_device([jpegs], "cpu")                              # on the CPU: no stream at all
    assert calls == [("decode_jpeg", "training", torch.device("cpu"))]


def test_decoding_a_batch_on_the_device_is_data_time_not_step_time(monkeypatch):
    """train_one_epoch under a fake clock: the loader is instant, each batch's decode on the
    device takes 2 s and each step 1 s; data_wait_s must hold the decodes, step_time_s the steps
    (today's count put the decode in the step: data_wait_frac 0, compute_clips_per_s too low)."""
    clock = [0.0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: clock[0]))

    def decoding(clips, device, *, non_blocking=False):
        assert not isinstance(clips, torch.Tensor)           # an encoded batch: JPEG frames
        clock[0] += 2.0
        return torch.zeros(len(clips), 2, 4, 4, 3, dtype=torch.uint8)

    class OneSecondNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(3, 2)

        def forward(self, x):
            clock[0] += 1.0
            return self.head(x.float().mean(dim=(1, 2, 3)))   # B x T x H x W x C -> B x C

    monkeypatch.setattr(loop, "clips_to_device", decoding)
    model = OneSecondNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fp32 = choose_precision("fp32", "cpu")
    encoded = [[object(), object()] for _ in range(3)]       # 3 batches of 2 clips (their frames unread)
    stats = loop.train_one_epoch(
        model, [(clips, torch.tensor([0, 1])) for clips in encoded],
        transform=nn.Identity(), optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        scaler=fp32.make_scaler(), policy=fp32, device="cpu")
    assert stats.steps == 3 and stats.epoch_time_s == 9.0
    assert stats.data_wait_s == 6.0 and stats.step_time_s == 3.0
