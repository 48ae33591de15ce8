"""Which process of a distributed length index build this is, from the launcher's variables.

``energon-ordering index`` runs as one process, or as one of many started by a launcher:

- ``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (the store of
  its agent, shared with the workers: ``TORCHELASTIC_USE_AGENT_STORE``);
- ``srun`` sets ``SLURM_PROCID`` and ``SLURM_NTASKS`` in every task of a job step
  (``SLURM_STEP_ID``); the rendezvous is the one the user names (``--rendezvous HOST:PORT``, or
  ``MASTER_ADDR`` / ``MASTER_PORT``), hosted by rank 0, so HOST is the step's first node.

:func:`launch_from_env` is pure (it reads the mapping it is given): a malformed variable is
refused in one line naming it, its value and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from energon_ordering.errors import LengthIndexError, show

__all__ = ["Launch", "launch_from_env", "parse_rendezvous"]


@dataclass(frozen=True)
class Launch:
    """One process of a distributed build.

    Attributes:
        rank: This process, in ``[0, world_size)``.
        world_size: Processes of the build (> 1).
        host: The rendezvous host (rank 0's store).
        port: The rendezvous port.
        launcher: Which launcher's variables said so.
        agent_store: The store is served by torchrun's agent (no process hosts one).
    """

    rank: int
    world_size: int
    host: str
    port: int
    launcher: Literal["torchrun", "slurm"]
    agent_store: bool = False


def _int(env: Mapping[str, str], name: str, fix: str, minimum: int = 0) -> int:
    value = env[name]
    try:
        number = int(value.strip())
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise LengthIndexError(
            f"length index: the launcher variable {name} = {show(value)} is not an integer >= "
            f"{minimum}; {fix}."
        )
    return number


def parse_rendezvous(value: str, what: str = "--rendezvous") -> tuple[str, int]:
    """``HOST:PORT`` -> ``(host, port)``; refuses anything else in one line naming ``what``."""
    host, sep, port = str(value).strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LengthIndexError(
            f"length index: {what} = {show(value)} is not HOST:PORT (a port in 1..65535); name "
            "the host of rank 0 and a free port, e.g. --rendezvous node001:29500."
        )
    return host.strip("[]"), int(port)


def launch_from_env(env: Mapping[str, str], rendezvous: str | None = None) -> Launch | None:
    """The distributed build this process belongs to, or None for a one-process build.

    Args:
        env: The process environment (``os.environ``).
        rendezvous: ``HOST:PORT`` the user named (``--rendezvous``); under Slurm it overrides
            ``MASTER_ADDR``/``MASTER_PORT``, under torchrun it is not needed.

    Raises:
        LengthIndexError: A launcher variable is malformed, a rank is outside the world, or
            Slurm started several tasks without a rendezvous.
    """
    if "RANK" in env or "WORLD_SIZE" in env:
        fix = "torchrun sets RANK and WORLD_SIZE; unset them for a one-process build"
        for name in ("RANK", "WORLD_SIZE"):
            if name not in env:
                raise LengthIndexError(f"length index: {name} is not set but "
                                       f"{'WORLD_SIZE' if name == 'RANK' else 'RANK'} is; {fix}.")
        rank, world = _int(env, "RANK", fix), _int(env, "WORLD_SIZE", fix, minimum=1)
        _check_rank(rank, world, "RANK", "WORLD_SIZE")
        if world == 1:
            return None
        host, port = _master(env, rendezvous, "torchrun")
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        return Launch(rank, world, host, port, "torchrun", agent_store=agent)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and (
        rendezvous is not None or "SLURM_STEP_ID" in env
    ):
        fix = "srun sets SLURM_PROCID and SLURM_NTASKS; run the command under srun"
        rank = _int(env, "SLURM_PROCID", fix)
        world = _int(env, "SLURM_NTASKS", fix, minimum=1)
        _check_rank(rank, world, "SLURM_PROCID", "SLURM_NTASKS")
        if world == 1:
            return None
        host, port = _master(env, rendezvous, "slurm")
        return Launch(rank, world, host, port, "slurm")
    if rendezvous is not None:
        parse_rendezvous(rendezvous)
        raise LengthIndexError(
            f"length index: --rendezvous {show(rendezvous)} was given, but neither torchrun "
            "(RANK, WORLD_SIZE) nor srun (SLURM_PROCID, SLURM_NTASKS) started this process; "
            "launch it with one of them, or drop --rendezvous for a one-process build."
        )
    return None


def _check_rank(rank: int, world: int, rank_var: str, world_var: str) -> None:
    if rank >= world:
        raise LengthIndexError(
            f"length index: {rank_var} = {rank} is not below {world_var} = {world}; the launcher "
            "variables are inconsistent (set by hand?): start the build with torchrun or srun."
        )


def _master(env: Mapping[str, str], rendezvous: str | None, launcher: str) -> tuple[str, int]:
    if rendezvous is not None:
        return parse_rendezvous(rendezvous)
    if "MASTER_ADDR" in env and "MASTER_PORT" in env:
        host = env["MASTER_ADDR"].strip()
        _, port = parse_rendezvous(f"{host}:{env['MASTER_PORT']}", "MASTER_ADDR:MASTER_PORT")
        return host, port
    fix = ("give --rendezvous HOST:PORT with HOST the first node of the step, e.g. "
           "--rendezvous \"$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1):29500\""
           if launcher == "slurm" else "torchrun sets them: start the build with torchrun")
    raise LengthIndexError(
        f"length index: {launcher} started several processes but no rendezvous is named "
        f"(MASTER_ADDR / MASTER_PORT are not set); {fix}."
    )
