"""Hugging Face export and import of an 8B-shaped model (the ``llama3_8b`` flavor: Llama-3-8B's shape): time and
peak host memory of each phase, each in its own process. Prints one JSON line.

    python benchmarks/bench_hf_interchange.py [--workdir DIR] [--max-shard-size 5GB] [--keep]
    python benchmarks/bench_hf_interchange.py --tiny   # a small shape on CPU, to check the script itself

1. A dump folder as a run leaves it: the model initialised (on the GPU when there is one) and saved by DCP in
   float32 (32 GB for 8B), ``config.toml`` (the trainer's resolved config), the byte tokenizer's copy.
2. ``python -m torchtitan_ext.export`` (bf16, 5GB shards): wall time and peak RSS (``wait4``), and the peak of
   anonymous memory (RssAnon polled), which leaves out the page cache the checkpoint files occupy.
3. ``load_hf(folder)`` (bf16 Decoder on the host) and ``load_hf_weights`` into a meta-built model materialised
   in float32 on the GPU (the trainer's ``checkpoint.initial_load_path`` on one GPU): time, peak RSS (the
   safetensors files are memory-mapped, so their pages count in RSS while mapped) and peak anonymous memory.

The files written are dropped from the page cache (``posix_fadvise``) before they are read, so the reads are
from the disk rather than from memory. Disk: the float32 checkpoint and the bf16 folder (about 48 GB for 8B);
the checkpoint is removed after the export and everything at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GB = 1e9
TINY = ["--model.dim", "256", "--model.n_layers", "4", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_hidden", "512", "--model.vocab_size", "4096"]


class AnonPeak:
    """The peak of a process's RssAnon (/proc/PID/status), polled every 20 ms in a thread."""

    def __init__(self, pid: int | str = "self"):
        self.path, self.peak, self._stop = f"/proc/{pid}/status", 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                with open(self.path) as f:
                    kb = next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
                self.peak = max(self.peak, kb * 1024)
            except (OSError, StopIteration):
                return
            time.sleep(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def drop_cache(folder: Path) -> None:
    """Ask the kernel to drop the files' cached pages (written data is flushed first)."""
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def job_config(dump: Path, tiny: bool):
    from torchtitan_ext.config.loader import parse_args

    return parse_args(["--model.flavor", "llama3_8b", "--data.tokenizer", "byte", "--job.dump_folder", str(dump),
                       "--training.seq_len", "8192", *(TINY + ["--training.seq_len", "256"] if tiny else [])])


def make_dump(dump: Path, tiny: bool, device: torch.device) -> dict:
    """A run's dump folder: config.toml, tokenizer/, checkpoint/step-1 (DCP, float32)."""
    import torch.distributed.checkpoint as dcp

    from torchtitan_ext.config.loader import to_toml
    from torchtitan_ext.data.tokenizers import ByteTokenizer
    from torchtitan_ext.models.decoder import Decoder
    from torchtitan_ext.models.flavors import resolve_model_args

    cfg = job_config(dump, tiny)
    tok = ByteTokenizer()
    args = resolve_model_args(cfg, tok.vocab_size)
    dump.mkdir(parents=True)
    (dump / "config.toml").write_text(to_toml(cfg))
    tok.save(dump / "tokenizer")
    start = time.perf_counter()
    with torch.device("meta"):
        model = Decoder(args)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.ndim > 1 else p.fill_(1.0)
    init_s = time.perf_counter() - start
    start = time.perf_counter()
    step = dump / "checkpoint" / "step-1"
    with warnings.catch_warnings():  # one process writing the checkpoint is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({f"model.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=str(step))
    save_s = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the import phase materialises its own copy on the GPU
    drop_cache(step)
    return {"params": params, "init_s": round(init_s, 1), "dcp_save_s": round(save_s, 1),
            "dcp_gb": round(sum(p.stat().st_size for p in step.iterdir()) / GB, 2)}


def run_measured(cmd: list[str]) -> tuple[float, int, int, str]:
    """(seconds, peak RSS bytes, peak RssAnon bytes, stdout) of a child process (its output through files, so
    that ``wait4`` reaps it and gives its own resource usage)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        anon = AnonPeak(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        secs = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        peak_anon = anon.stop()
        out.seek(0)
        err.seek(0)
        stdout = out.read()
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{stdout[-2000:]}\n{err.read()[-4000:]}")
    return secs, usage.ru_maxrss * 1024, peak_anon, stdout


def import_phase(phase: str, folder: str) -> None:
    """One import in this process (a child of the benchmark): prints {"seconds", "bytes_read", "anon"}."""
    from torchtitan_ext.hf.load import load_hf, load_hf_weights, read_config
    from torchtitan_ext.models.decoder import Decoder

    anon = AnonPeak()
    start = time.perf_counter()
    if phase == "load_hf":
        model = load_hf(folder)
        read = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        secs = time.perf_counter() - start
    else:
        args = read_config(Path(folder))  # the job's shape (the run's config.toml gives the same)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        with torch.device("meta"):
            model = Decoder(args)
        model.to_empty(device=device)
        model.init_buffers(device)
        start = time.perf_counter()  # the load alone: the model is allocated as the trainer has it
        read = load_hf_weights([model], folder, args)
        if device.type == "cuda":
            torch.cuda.synchronize()
        secs = time.perf_counter() - start
    print(json.dumps({"seconds": secs, "bytes_read": read, "anon": anon.stop()}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=tempfile.gettempdir(), help="where the dump and the export go")
    p.add_argument("--max-shard-size", default=None, help="default 5GB (2MB with --tiny)")
    p.add_argument("--tiny", action="store_true", help="a small shape on CPU, to check the script")
    p.add_argument("--keep", action="store_true", help="keep the dump and the export folder")
    p.add_argument("--phase", help=argparse.SUPPRESS)  # internal: one import in a child process
    p.add_argument("--folder", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.phase:
        import_phase(a.phase, a.folder)
        return
    device = torch.device("cuda" if torch.cuda.is_available() and not a.tiny else "cpu")
    work = Path(tempfile.mkdtemp(prefix="bench_hf_", dir=a.workdir))
    dump, out = work / "dump", work / "hf"
    shard = a.max_shard_size or ("2MB" if a.tiny else "5GB")
    try:
        res = {"bench": "hf_interchange", "shape": "tiny" if a.tiny else "llama3_8b", "device": str(device),
               "torch": torch.__version__, "cpus": os.cpu_count(), "max_shard_size": shard}
        res.update(make_dump(dump, a.tiny, device))
        print(f"dump written: {res}", file=sys.stderr, flush=True)  # progress, in case a later phase fails
        secs, rss, anon, stdout = run_measured([sys.executable, "-m", "torchtitan_ext.export", "--checkpoint",
                                                str(dump), "--output", str(out), "--max-shard-size", shard])
        weights = sorted(out.glob("model*.safetensors"))
        res.update(export_s=round(secs, 1), export_peak_rss_gb=round(rss / GB, 2),
                   export_peak_anon_gb=round(anon / GB, 2), shards=len(weights),
                   largest_shard_gb=round(max(w.stat().st_size for w in weights) / GB, 2),
                   folder_gb=round(sum(w.stat().st_size for w in weights) / GB, 2),
                   export_line=stdout.strip().splitlines()[-1])
        print(f"exported: {res}", file=sys.stderr, flush=True)
        shutil.rmtree(dump / "checkpoint")  # disk: the bf16 folder alone from here
        for phase in ("load_hf", "load_hf_weights"):
            drop_cache(out)
            secs, rss, anon, stdout = run_measured([sys.executable, __file__, "--phase", phase, "--folder", str(out)])
            child = json.loads(stdout.strip().splitlines()[-1])
            res.update({f"{phase}_s": round(child["seconds"], 1), f"{phase}_process_s": round(secs, 1),
                        f"{phase}_peak_rss_gb": round(rss / GB, 2), f"{phase}_peak_anon_gb": round(anon / GB, 2),
                        f"{phase}_read_gb": round(child["bytes_read"] / GB, 2)})
            print(f"{phase} done: {res}", file=sys.stderr, flush=True)
        print(json.dumps(res), flush=True)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
