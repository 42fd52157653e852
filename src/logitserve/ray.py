"""Teacher replicas as Ray actors: each replica's ranks in one STRICT_PACK placement group, one bundle per rank.

Rank 0 of each replica is an actor that runs `logitserve serve` as a subprocess and owns the
actors of its other ranks (torchrun's variables set for each: RANK, WORLD_SIZE, MASTER_ADDR..);
it reports `host:port` once the server prints that it is serving. Health and restarts are Ray's:
a rank whose server exits ends its actor, rank 0 then ends too, and Ray restarts it (up to
`max_restarts`) with fresh ranks in the same bundles, on a new port: `addresses()` re-reads.
Ray is imported only when something is launched (`pip install 'logitserve[ray]'`).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

SERVING = re.compile(r"logitserve: serving \S+ on \S+:(\d+)")
STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")


@dataclass(frozen=True)
class RayTeacherConfig:
    """What to launch: `replicas` copies of `logitserve serve <serve_args>`, each on its own placement group."""

    serve_args: tuple[str, ...] = ()        # `logitserve serve` flags (--model, --tp/--cp/--pp, --dtype ...), no --port
    replicas: int = 1
    gpus_per_rank: float = 0.0              # 1 on GPU nodes: Ray gives each rank's actor its own device
    cpus_per_rank: float = 1.0
    resources_per_rank: Mapping[str, float] = field(default_factory=dict)   # custom Ray resources per bundle
    strategy: str = "STRICT_PACK"           # a replica's ranks on one node (its TP/CP/PP groups talk over NVLink)
    max_restarts: int = 3                   # per replica, Ray's actor max_restarts (-1: without end)
    ready_timeout_s: float = 600.0          # for one replica's server to load and open its port
    host: str = "0.0.0.0"                   # the servers' bind address; addresses name the node's IP
    stop_grace_s: float = 30.0              # SIGTERM, then this long to drain before SIGKILL

    def __post_init__(self):
        if self.replicas < 1 or self.cpus_per_rank < 0 or self.gpus_per_rank < 0:
            raise ValueError(f"replicas={self.replicas} must be >= 1, cpus_per_rank={self.cpus_per_rank} and "
                             f"gpus_per_rank={self.gpus_per_rank} >= 0")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r}: choose from {STRATEGIES}")
        if self.max_restarts < -1 or not self.ready_timeout_s > 0:
            raise ValueError(f"max_restarts={self.max_restarts} must be >= -1 and ready_timeout_s="
                             f"{self.ready_timeout_s} > 0")
        taken = [a for a in self.serve_args if a.split("=")[0] in ("--port", "--host")]
        if taken:
            raise ValueError(f"serve_args: {taken[0]} is set by the launcher (host=, a free port per replica)")
        self.ranks    # noqa: B018 - parses --tp/--cp/--pp now, so a bad value fails here

    @property
    def ranks(self) -> int:
        """Ranks of one replica: tp * cp * pp from serve_args."""
        p = argparse.ArgumentParser(add_help=False)
        for flag in ("--tp", "--cp", "--pp"):
            p.add_argument(flag, type=int, default=1)
        try:
            known, _ = p.parse_known_args(list(self.serve_args))
        except SystemExit:
            raise ValueError(f"serve_args: --tp/--cp/--pp must be integers, got {list(self.serve_args)}") from None
        if min(known.tp, known.cp, known.pp) < 1:
            raise ValueError(f"serve_args: --tp {known.tp} --cp {known.cp} --pp {known.pp} must each be >= 1")
        return known.tp * known.cp * known.pp

    def bundles(self) -> list[dict]:
        """One placement-group bundle per rank."""
        one = {"CPU": self.cpus_per_rank, **({"GPU": self.gpus_per_rank} if self.gpus_per_rank else {}),
               **self.resources_per_rank}
        return [dict(one) for _ in range(self.ranks)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Rank:
    """One rank's actor: its `logitserve serve` process, watched; rank 0 also starts and watches the others."""

    def __init__(self, config: RayTeacherConfig, rank: int = 0, master: Optional[tuple[str, int]] = None,
                 placement_group=None):
        import ray

        self.config, self.rank, self.ip = config, rank, ray.util.get_node_ip_address()
        self.log: collections.deque = collections.deque(maxlen=200)
        self.port: Optional[int] = None
        self.ready, self.stopping, self.others = threading.Event(), False, []
        world = config.ranks
        env = dict(os.environ)
        if world > 1:
            master = master or (self.ip, _free_port())
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
            if rank == 0:
                self.others = [_actor(config, placement_group, r, max_restarts=0).remote(config, r, master)
                               for r in range(1, world)]
        self.proc = subprocess.Popen([sys.executable, "-m", "logitserve.server.cli", "serve", *config.serve_args,
                                      "--host", config.host, "--port", "0"], env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            print(line, end="", flush=True)                  # into Ray's worker log
            m = SERVING.search(line)
            if m and self.port is None:
                self.port = int(m.group(1))
                self.ready.set()

    def _watch(self) -> None:
        """End this actor when its server or another rank's actor is gone: Ray restarts rank 0 with fresh ranks."""
        import ray

        while True:
            time.sleep(0.5)
            if self.stopping:
                return
            lost = self.proc.poll() is not None
            if not lost and self.others:
                try:
                    ray.get([o.alive.remote() for o in self.others], timeout=30)
                except Exception:                     # noqa: BLE001 - any failure to answer is a lost rank
                    lost = True
            if lost and not self.stopping:
                print(f"logitserve.ray: rank {self.rank} lost (server exit {self.proc.poll()}); ending the actor",
                      flush=True)
                self._terminate(grace_s=5.0)
                os._exit(1)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def server_pid(self) -> int:
        return self.proc.pid

    def address(self) -> str:
        """`ip:port` once the server is serving; RuntimeError with its last lines if it exits or times out first.
        A server that exits after serving ends this actor (see _watch): the call is then retried by Ray on the
        restarted replica (max_task_retries), which answers with its new port."""
        deadline = time.monotonic() + self.config.ready_timeout_s
        while not self.ready.wait(0.2) or self.proc.poll() is not None:
            if self.proc.poll() is not None and self.ready.is_set() and not self.stopping:
                time.sleep(0.2)                      # serving, then lost: _watch ends the actor within seconds
                continue
            if self.proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with {self.proc.poll()}" if self.proc.poll() is not None else \
                    f"was not serving within {self.config.ready_timeout_s:g} s"
                raise RuntimeError(f"logitserve serve {why}:\n" + "".join(self.log))
        return f"{self.ip}:{self.port}"

    def stop(self) -> int:
        """Drain and stop the server (rank 0 stops the other ranks through their process group), then the others."""
        import ray

        self.stopping = True
        code = self._terminate(self.config.stop_grace_s)
        ray.get([o.stop.remote() for o in self.others])
        return code

    def _terminate(self, grace_s: float) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()


def _actor(config: RayTeacherConfig, pg, bundle: int, max_restarts: int):
    """The Rank actor class, placed in bundle `bundle` of `pg` with one rank's resources. Its methods only read
    state, so a call that a dying replica never answered is sent again to the restarted one."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return ray.remote(Rank).options(
        num_cpus=config.cpus_per_rank, num_gpus=config.gpus_per_rank, resources=dict(config.resources_per_rank),
        max_restarts=max_restarts, max_task_retries=-1 if max_restarts else 0, max_concurrency=8,
        scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle))


class RayTeachers:
    """The launched replicas: `addresses()` (re-read: a restarted replica listens on a new port), `address()` for
    TeacherClient / AsyncTeacherClient (`ipv4:a,b`), `stop()`. From `launch(config)`, inside a Ray driver."""

    def __init__(self, config: RayTeacherConfig):
        import ray
        from ray.util.placement_group import placement_group

        self.config = config
        self.groups = [placement_group(config.bundles(), strategy=config.strategy) for _ in range(config.replicas)]
        try:
            ray.get([g.ready() for g in self.groups], timeout=config.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            self._remove_groups()
            raise RuntimeError(f"Ray could not place {config.replicas} replica(s) of {config.bundles()} "
                               f"({config.strategy}) within {config.ready_timeout_s:g} s: "
                               f"cluster resources {ray.cluster_resources()}") from None
        self.actors = [_actor(config, g, 0, config.max_restarts).remote(config, 0, None, g) for g in self.groups]

    def addresses(self, timeout_s: Optional[float] = None) -> list[str]:
        """Every replica's `host:port`, asked now (waits for replicas still starting or restarting)."""
        import ray

        return ray.get([a.address.remote() for a in self.actors], timeout=timeout_s)

    def address(self, timeout_s: Optional[float] = None) -> str:
        """`ipv4:a:p,b:q`: one client address over every replica (round-robin, retried on UNAVAILABLE)."""
        return "ipv4:" + ",".join(self.addresses(timeout_s))

    def stop(self) -> None:
        """Drain every replica's server, then end the actors and free the placement groups."""
        import ray

        for a in self.actors:
            try:
                ray.get(a.stop.remote(), timeout=self.config.stop_grace_s + 30)
            except Exception:                         # noqa: BLE001 - a lost replica has nothing left to stop
                pass
            ray.kill(a, no_restart=True)
        self._remove_groups()

    def _remove_groups(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for g in self.groups:
            remove_placement_group(g)

    def __enter__(self) -> "RayTeachers":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch(config: RayTeacherConfig) -> RayTeachers:
    """Place and start the replicas, and wait until all serve; ray.init() first (or inside the trainer's driver)."""
    teachers = RayTeachers(config)
    try:
        teachers.addresses()
    except BaseException:
        teachers.stop()
        raise
    return teachers


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m logitserve.ray [options] -- <logitserve serve flags>`: launch, print the address, keep it up."""
    ap = argparse.ArgumentParser(prog="python -m logitserve.ray", description=main.__doc__)
    ap.add_argument("--ray-address", default="auto", help="the Ray cluster to join (ray.init's address)")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--gpus-per-rank", type=float, default=0.0)
    ap.add_argument("--cpus-per-rank", type=float, default=1.0)
    ap.add_argument("--max-restarts", type=int, default=3)
    ap.add_argument("--address-file", help="also write the client address here, rewritten when it changes")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: the flags of `logitserve serve`")
    args = ap.parse_args(argv)
    import ray

    serve_args = tuple(args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args)
    ray.init(address=args.ray_address)
    teachers = launch(RayTeacherConfig(serve_args, args.replicas, args.gpus_per_rank, args.cpus_per_rank,
                                       max_restarts=args.max_restarts))
    signal.signal(signal.SIGTERM, _interrupt)        # a scheduler's stop drains the replicas as Ctrl-C does
    shown = None
    try:
        while True:
            address = teachers.address()
            if address != shown:
                print(f"logitserve.ray: serving {address}", flush=True)
                if args.address_file:
                    with open(args.address_file + ".tmp", "w") as f:
                        f.write(address + "\n")
                    os.replace(args.address_file + ".tmp", args.address_file)
                shown = address
            time.sleep(5)
    except KeyboardInterrupt:
        return 0
    finally:
        teachers.stop()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
