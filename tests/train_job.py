"""The training job of the end-to-end tests (run as a real process: under torchrun,
``elastictrain run``, ``srun`` or alone; never imported by pytest).

    python tests/train_job.py ROOT STEPS [options]

It restores from ROOT, trains a small model to STEPS with a snapshot policy the test
chooses, and closes (``params.digest``); one loop for every test, which picks the model,
the optimizer, the batch, the storage faults and where the job stops for the test:

* ``--fsdp``: the model sharded with FSDP2 (``fully_shard`` on each linear layer and the
  root, a CPU mesh of the world size) instead of DDP; rank 0 logs ``params.digest`` of
  the full parameters (gathered) at the end, as the manager does for replicated state;
  with DDP every rank logs ``params.rank_digest`` of its own replica at the end.
  ``--shard-last-dim1``: the last linear layer's weight sharded along its second
  dimension (as tensor parallelism splits one), the others along their first.
* ``--full-state FILE``: at the end (before ``close()``) rank 0 writes the whole model and
  optimizer state, ``torch.save({"model", "optimizer"})``: the unwrapped model's and the
  optimizer's ``state_dict()``, or for FSDP2 DCP's full ``get_state_dict`` (gathered).
* ``--every``, ``--memory-every``, ``--memory-dir``, ``--persister``: the snapshot
  policy; what is not given comes from ``ELASTICTRAIN_*`` (the manager is built without
  ``ctx`` or ``config``, as a user script would).
* ``--store faults``: payload writes fail while ``FAULTS_JOB_FAIL_WHILE`` exists, and
  ``FAULTS_JOB_TRICKLE=CHUNK_BYTES:DELAY_S`` makes a slow upload that keeps moving;
  ``--store gated JOURNAL GATE``: in the first attempt rank 0's payload write of
  ``--stall-step`` stalls mid-file, forever (tests/fault_stores.py).
* ``--step-s``: each step's compute time; ``FAULTS_JOB_STEP_S`` sets it too.
* ``--exact``: each step's batch is a function of the step and the rank only, and every
  step also draws from the global python, torch and numpy RNGs (seeded per rank), so a
  resume with any rank's RNG state wrong is not bit-exact.
* ``--park N --gates DIR``: in the first attempt every rank stops after step N, writes
  ``DIR/rank<r>.json`` with its PID and waits for ``DIR/go`` (the test kills what it must
  meanwhile). ``--park N --stdin``: after step N the job prints ``{"parked": N}`` and
  reads a line from stdin (synchronised by the pipe).
* ``--park-in N --gates DIR``: in the first attempt every rank stops in the middle of
  step N, between its forward and its backward, and parks on the gates as ``--park``
  does (the test kills a node meanwhile: the survivors' backward then fails).
* ``--park-after N --gates DIR``: in the first attempt every rank stops in step N after
  its backward (the gradients all-reduced, the optimizer step not taken) and parks on
  the gates (the test kills a node meanwhile: a node lost after its last all-reduce).
* ``--eval-s S``: once a ``--park`` after a step is released, the job spends S seconds
  before its next step (an evaluation: a pause in training, not in the process).
* ``--again M``: once the first park was released (``DIR/go``), the same kind of park
  happens once more, at step M, in any attempt, on ``DIR/again`` (a second event after
  the first: the test acts on the job the first one left).
* ``--die-in N``: rank 1 of the first attempt SIGKILLs itself in the middle of step N,
  between its forward and its backward; ``--late-survivor``: rank 0 meets that death
  only after the agent saw it (it starts its backward once ``agent.failure_detected`` is
  in the run's event log).
* ``--exit-stall stop|busy``: after the run finished (closed, shut down), rank 0 of the
  first attempt stalls in its exit: it stops itself (SIGSTOP, as a chaos ``stop`` landing
  after the run finished) or keeps a core busy for ``--busy-s`` seconds (a long but live
  exit) while rank 1 exits 0.
* ``--say``: one JSON line ``{"tier", "from_step", "memory_dir"}`` after the restore and
  ``{"done": STEP}`` at the end (the one-process node tests read them).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

import elastictrain as et
from elastictrain.core.log import get_logger
from elastictrain.launcher.spawn import EVENTS_DIR_VAR
from elastictrain.snapshot.format.digest import param_digest
from elastictrain.storage import Store, open_store
from tests.fault_stores import GatedStore, SwitchedStore, TricklingStore

PARK_TIMEOUT_S = 300.0


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root")
    p.add_argument("steps", type=int)
    p.add_argument("--every", type=int, help="durable snapshot every N steps")
    p.add_argument("--memory-every", type=int)
    p.add_argument("--memory-dir")
    p.add_argument("--persister")
    p.add_argument("--model", choices=["linear", "linear-nobias", "mlp"], default="linear",
                   help="linear-nobias: one parameter, so DDP's bucket layout (the order in "
                        "which more than two ranks' gradients are summed) is the same in "
                        "every process: bit-exact at any world size")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (sharded state), not DDP")
    p.add_argument("--shard-last-dim1", action="store_true",
                   help="FSDP2: the last linear layer's weight sharded along dimension 1")
    p.add_argument("--full-state", type=Path, help="rank 0 writes the full state here")
    p.add_argument("--width", type=int, default=8, help="features of the linear model")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", default="0", help="torch's seed; 'root': the length of ROOT "
                   "(another storage, another model)")
    p.add_argument("--frozen-mb", type=int, default=0,
                   help="a frozen parameter of that size (no compute, in every snapshot)")
    p.add_argument("--store", nargs="+", default=["plain"], metavar="KIND",
                   help="plain (ROOT given as a URL), open (open_store(ROOT)), faults, "
                        "or gated JOURNAL GATE")
    p.add_argument("--stall-step", type=int, default=20)
    p.add_argument("--step-s", type=float,
                   default=float(os.environ.get("FAULTS_JOB_STEP_S", "0")))
    p.add_argument("--exact", action="store_true")
    p.add_argument("--park", type=int, default=0)
    p.add_argument("--gates", type=Path)
    p.add_argument("--stdin", action="store_true", help="park on stdin, not on gates")
    p.add_argument("--park-in", type=int, default=0)
    p.add_argument("--again", type=int, default=0)
    p.add_argument("--eval-s", type=float, default=0.0)
    p.add_argument("--park-after", type=int, default=0)
    p.add_argument("--die-in", type=int, default=0)
    p.add_argument("--late-survivor", action="store_true")
    p.add_argument("--final-save", action="store_true", help="a snapshot after the last step")
    p.add_argument("--exit-stall", choices=["stop", "busy"])
    p.add_argument("--busy-s", type=float, default=0.0)
    p.add_argument("--say", action="store_true")
    p.add_argument("--loss", action="store_true", help="pass the loss to step(loss=…)")
    p.add_argument("--wrong-rank", type=int, default=None,
                   help="after a restore, this rank's arithmetic goes wrong: its loss, and "
                   "so every rank's gradients, become NaN")
    return p.parse_args(argv)


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def storage(args: argparse.Namespace, first_attempt: bool) -> str | Store:
    kind, *rest = args.store
    if kind == "plain":
        return str(args.root)
    store: Store = open_store(args.root)
    if kind == "faults":
        if os.environ.get("FAULTS_JOB_FAIL_WHILE"):
            store = SwitchedStore(store, os.environ["FAULTS_JOB_FAIL_WHILE"])  # type: ignore[assignment]
        if os.environ.get("FAULTS_JOB_TRICKLE"):
            chunk, delay = os.environ["FAULTS_JOB_TRICKLE"].split(":")
            store = TricklingStore(store, int(chunk), float(delay))  # type: ignore[assignment]
    elif kind == "gated" and first_attempt:
        journal, gate = rest
        store = GatedStore(store, journal, gate,  # type: ignore[assignment]
                           stall_steps={args.stall_step})
    return store


def model_of(args: argparse.Namespace) -> torch.nn.Module:
    net: torch.nn.Module
    if args.model == "mlp":
        net = torch.nn.Sequential(torch.nn.Linear(args.width, 64), torch.nn.Tanh(),
                                  torch.nn.Linear(64, 8))
    else:
        net = torch.nn.Linear(args.width, args.width, bias=args.model == "linear")
    if args.frozen_mb:
        net.frozen = torch.nn.Parameter(torch.ones(args.frozen_mb * 2**18), requires_grad=False)
    return net


def sharded(net: torch.nn.Module, world_size: int,
            last_dim1: bool = False) -> torch.nn.Module:
    """FSDP2 over every rank (CPU, gloo): each linear layer and the root (with
    ``last_dim1`` the last layer's weight split along dimension 1). (Imported here:
    FSDP2 and DCP cost a DDP job's every worker a second of start-up.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world_size,))
    layers = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    for layer in layers:
        along_dim1 = last_dim1 and layer is layers[-1]
        fully_shard(layer, mesh=mesh, shard_placement_fn=(
            lambda p: Shard(1) if p.dim() > 1 else None) if along_dim1 else None)
    fully_shard(net, mesh=mesh)
    return net


def write_full_state(path: Path, model: torch.nn.Module, net: torch.nn.Module, opt: Any,
                     fsdp: bool, rank: int) -> None:
    """(every rank: FSDP2 gathers) rank 0 writes the whole model and optimizer state."""
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_state, optim_state = get_state_dict(
            model, [opt], options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        model_state, optim_state = net.state_dict(), opt.state_dict()
    if rank == 0:
        torch.save({"model": model_state, "optimizer": optim_state}, path)


def full_digest(model: torch.nn.Module, rank: int) -> None:
    """(all ranks: a gather) rank 0 logs ``params.digest`` of the full parameters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                   cpu_offload=True))
    if rank == 0:
        digest = hashlib.sha256()
        for key in sorted(state):
            digest.update(key.encode())
            digest.update(state[key].detach().contiguous().reshape(-1).view(torch.uint8)
                          .numpy().tobytes())
        get_logger("elastictrain.snapshot").info("params.digest",
                                                 param_digest=digest.hexdigest())


def park_on_gates(gates: Path, rank: int) -> None:
    """Tell the test where we are, then wait for it (a condition with a deadline)."""
    gates.mkdir(parents=True, exist_ok=True)
    (gates / f"rank{rank}.json").write_text(json.dumps({"pid": os.getpid(), "rank": rank}))
    deadline = time.monotonic() + PARK_TIMEOUT_S
    while not (gates / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def park_gates(args: argparse.Namespace, first_attempt: bool, step: int,
               first: int) -> Path | None:
    """Where a park at ``step`` waits, if it does (``first``: the step of the park,
    ``--park`` or ``--park-in``): in the first attempt on the gates; with ``--again``,
    once more in any attempt once the first was released."""
    released = (args.gates / "go").exists()
    if step == first and first_attempt and not released:
        return Path(args.gates)
    if step == args.again and released and not (args.gates / "again" / "go").exists():
        return Path(args.gates) / "again"
    return None


def await_event(events_dir: Path, name: str) -> None:
    """Wait until an event ``name`` is in a file under ``events_dir`` (with a deadline)."""
    deadline = time.monotonic() + PARK_TIMEOUT_S
    while time.monotonic() < deadline:
        for file in events_dir.rglob("*.jsonl"):
            for line in file.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    if json.loads(line).get("event") == name:
                        return
        time.sleep(0.02)


def main() -> None:
    args = parse(sys.argv[1:])
    rt = et.init()
    try:
        train(args, rt)
    finally:
        et.shutdown()
    if args.exit_stall and rt.ctx.rank == 0 and rt.env.restart_count == 0:
        if args.exit_stall == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            until = time.monotonic() + args.busy_s
            while time.monotonic() < until:
                pass


def train(args: argparse.Namespace, rt: Any) -> None:
    rank = rt.ctx.rank
    first_attempt = rt.env.restart_count == 0
    torch.manual_seed(len(args.root) if args.seed == "root" else int(args.seed))
    if args.exact:
        random.seed(rank)  # a stream of its own per rank (restored, not re-seeded)
        np.random.seed(rank)
    net = model_of(args)
    if args.fsdp:
        model = sharded(net, rt.ctx.world_size, args.shard_last_dim1)
    else:
        model = DistributedDataParallel(net) if rt.ctx.initialized else net
    opt: torch.optim.Optimizer = (torch.optim.AdamW if args.optimizer == "adamw"
                                  else torch.optim.SGD)(model.parameters(), lr=args.lr)
    policy = {name: value for name, value in (
        ("every_steps", args.every), ("memory_every", args.memory_every),
        ("memory_dir", args.memory_dir), ("persister", args.persister)) if value is not None}
    snap = et.SnapshotManager(storage(args, first_attempt), model=model, optimizer=opt,
                              **policy)
    info = snap.restore()
    if args.say:
        tier = snap._node_memory.tier
        say(tier=info.tier, from_step=info.from_step,
            memory_dir=None if tier is None else str(tier.path))
    while snap.step_count < args.steps:
        if args.exact:
            data = torch.Generator().manual_seed(1000 * snap.step_count + rank)
            noise = torch.rand(args.batch, args.width) * random.random() * float(
                np.random.rand())
            x = torch.randn(args.batch, args.width, generator=data) + noise
        else:
            x = torch.randn(args.batch, args.width)
        loss = model(x).pow(2).mean()
        if args.wrong_rank == rank and info.resumed:
            loss = loss * float("nan")
        gates = (park_gates(args, first_attempt, snap.step_count + 1, args.park_in)
                 if args.park_in else None)
        if gates is not None:
            park_on_gates(gates, rank)
        if first_attempt and rank == 1 and snap.step_count + 1 == args.die_in:
            os.kill(os.getpid(), signal.SIGKILL)
        if first_attempt and args.late_survivor and snap.step_count + 1 == args.die_in:
            await_event(Path(os.environ[EVENTS_DIR_VAR]), "agent.failure_detected")
        loss.backward()
        if first_attempt and snap.step_count + 1 == args.park_after:
            park_on_gates(args.gates, rank)
        opt.step()
        opt.zero_grad()
        time.sleep(args.step_s)  # the job's compute time per step (a workload, not a wait)
        snap.step(loss=loss.detach() if args.loss else None)
        if args.park and args.stdin and snap.step_count == args.park:
            snap.wait()
            say(parked=args.park)
            sys.stdin.readline()
        elif args.park and not args.stdin and (
                gates := park_gates(args, first_attempt, snap.step_count, args.park)):
            # A copy behind commits once the training thread judged it (at the next
            # step's fence, or here): a parked rank takes no next step.
            snap.wait()
            park_on_gates(gates, rank)
            time.sleep(args.eval_s)  # the evaluation's time (a workload, not a wait)
    if args.final_save:
        snap.save()
    if args.full_state:
        write_full_state(args.full_state, model, net, opt, args.fsdp, rank)
    if args.fsdp:
        full_digest(model, rank)
    else:  # every replica's own: the tests check that every rank ends on one state
        get_logger("elastictrain.snapshot").info(
            "params.rank_digest", param_digest=param_digest(net), final_step=snap.step_count)
    snap.close()  # logs params.digest and run.finished (final_step) on rank 0
    if args.say:
        say(done=snap.step_count)


if __name__ == "__main__":
    main()
