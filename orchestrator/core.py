"""The orchestrator: keeps episodes of GRPO groups running across env services and records results.

    dispatch loop (one task): while the scheduler names an eligible env, start a new group of it
        (group_size members, one session each) or dispatch one of its pending members
    attempt (one task per running episode): open session -> POST /episodes (held open) -> settle
    settle: model outcome       -> finish session (trajectory recorded) -> member done
            (completed, or truncated by max_turns / max_tokens)
            refused (429/503)   -> member pending again, service backs off briefly
            failure             -> member pending again (attempt charged), old session aborted;
            (env or infrastructure: env_error, deadline_exceeded, sandbox_error, llm_error,
             service_error, orchestrator_error)
                                   after max_attempts failures: session finished "failed", given up
    a service turning unhealthy: its running attempts are cancelled and handled as failures
    a group whose members are all done or given up: its GroupRecord is appended (ledger, once), or,
        with dynamic sampling and equal rewards, it is filtered: never appended, its samples deleted

Everything here runs on one event loop; state changes are synchronous between awaits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, Optional

from asyncrl.config import OrchestratorConfig
from asyncrl.protocols.env_service import EpisodeReason, EpisodeRequest, EpisodeResponse, OutcomeClass
from asyncrl.protocols.orchestrator import (EnvStatus, HeartbeatRequest, OverheadSummary, PauseResponse,
                                            RegisterRequest, StatusResponse)
from asyncrl.store import Store
from orchestrator.backpressure import Backpressure, Signal, Staleness, UnconsumedGroups
from orchestrator.counters import Counters
from orchestrator.deadlines import EpisodeDeadlines
from orchestrator.dynamic_sampling import DynamicSampler, Verdict
from orchestrator.envclient import EnvClient, Outcome
from orchestrator.groups import Group, Member, MemberState
from orchestrator.http import SendClock, client_session
from orchestrator.ledger import Ledger
from orchestrator.metrics import OrchestratorMetrics
from orchestrator.outcomes import ORCHESTRATOR_ERROR, SERVICE_ERROR, by_class, outcome_class
from orchestrator.registry import Registry, Service
from orchestrator.scheduler import EnvQueue, Scheduler
from orchestrator.sessions import GatewayError, make_sessions

log = logging.getLogger("orchestrator")

REFUSAL_BACKOFF_S = 0.25


class Orchestrator:
    def __init__(self, cfg: OrchestratorConfig, store: Store) -> None:
        self.cfg = cfg
        self.store = store
        self.registry = Registry(cfg.heartbeat_timeout_s)
        if cfg.dynamic_sampling.enabled and cfg.group_size < 2:
            raise ValueError("dynamic sampling needs group_size >= 2: a group of one always has equal rewards")
        self.scheduler = Scheduler(cfg.group_size, cfg.max_in_flight, cfg.domain_weights, cfg.rate_limits)
        self.sampler = DynamicSampler(cfg.dynamic_sampling, cfg.groups_per_step)
        self.metrics = OrchestratorMetrics(pause_reasons=lambda: self.pause_reasons)
        self.deadlines = EpisodeDeadlines(cfg.episode_deadline, cfg.episode_timeout_s)
        self.counters = Counters()
        self.groups: dict[str, Group] = {}
        """Open groups (accepted, not yet complete)."""
        self.open_by_env: Counter[str] = Counter()
        """Open groups per env (backpressure asks before every new group: kept, not counted each time)."""
        self.operator_paused = False
        self.awaited_envs = list(cfg.wait_for_envs)
        """Envs new groups still wait for (their tasks are not listed yet), until wait_for_envs_s have passed."""
        self._await_until = time.monotonic() + cfg.wait_for_envs_s
        self.http = client_session()
        self.envs = EnvClient(self.http, cfg.env_token)
        self.sessions = make_sessions(cfg, self.http)
        self.ledger = Ledger(store, self.counters.to_meta)
        self.metrics.groups_lost.set_function(lambda: self.ledger.records_lost)
        self.backpressure = Backpressure(cfg, store, self._signals(), self.wake)
        self._running: dict[str, dict[str, tuple[Group, Member, asyncio.Task]]] = {}
        """env_id -> episode_id -> the attempt running at that service."""
        self.incarnation = 1
        """This process's start number in the run (orch:meta `incarnation`, set by restore): part of its episode ids."""
        self.settling = 0
        """Attempts whose env service has answered (slot freed) and whose outcome is being recorded."""
        self._wake = asyncio.Event()
        self._woken_at: Optional[float] = None
        """When the event that triggered the next dispatch round happened (scheduling-overhead clock)."""
        self._background: set[asyncio.Task] = set()
        self._attempts: set[asyncio.Task] = set()
        """Every attempt task, running at its service or settling: `close` stops them all, so no settle runs on
        into clients that close under it (it failed, and counted a retry, at every shutdown)."""

    def _signals(self) -> list[Signal]:
        signals: list[Signal] = []
        if self.cfg.max_unconsumed_groups > 0:
            signals.append(UnconsumedGroups(self.cfg.max_unconsumed_groups, lambda: self.ledger.groups_recorded,
                                            lambda: self.ledger.unwritten_completions, lambda: self.open_by_env,
                                            self.scheduler.shares))
        if self.cfg.staleness_limit is not None:
            signals.append(Staleness(self.cfg.staleness_limit, self.cfg.groups_per_step, self._budgeted_groups))
        return signals

    def _budgeted_groups(self) -> int:
        """Groups the staleness rule counts: those that can reach the trainer usable (open, or appended with
        more than half of their members done). A group the trainer will drop (too many failed members) or
        that dynamic sampling filtered frees its place at once, so a step can still be filled: counting
        every started group deadlocked a sync run whose batch held one such group (the trainer waited for
        one more group, the orchestrator for the push)."""
        return self.counters.ordinal - self.counters.not_usable()

    # Events ---------------------------------------------------------------------------------------
    def wake(self) -> None:
        """Something may be dispatchable now (a slot freed, a service came, work was queued)."""
        if self._woken_at is None:
            self._woken_at = time.monotonic()
        self._wake.set()

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    @property
    def pause_reasons(self) -> list[str]:
        """What holds new groups of every env (an env held alone shows in its own status: EnvStatus.held)."""
        return ((["operator"] if self.operator_paused else []) + (["waiting_for_envs"] if self._awaiting() else [])
                + self.backpressure.reasons(list(self.scheduler.queues) or [None]))

    def add_group(self, group: Group) -> None:
        """A group opens (started, or restored by a restarted orchestrator)."""
        self.groups[group.group_id] = group
        self.open_by_env[group.env] += 1

    def _awaiting(self) -> list[str]:
        """The run's envs whose tasks are not listed yet, while new groups wait for them (wait_for_envs)."""
        if self.awaited_envs:
            self.awaited_envs = [name for name in self.awaited_envs
                                 if name not in self.scheduler.queues or self.scheduler.queues[name].tasks is None]
            if self.awaited_envs and time.monotonic() >= self._await_until:
                log.warning("new groups start without env(s) %s: not serving tasks %gs after start",
                            self.awaited_envs, self.cfg.wait_for_envs_s)
                self.awaited_envs = []
        return self.awaited_envs

    # Dispatch loop --------------------------------------------------------------------------------
    async def dispatch_forever(self) -> None:
        trigger = time.monotonic()
        while True:
            self._wake.clear()
            self._woken_at = None
            delay = self.dispatch_ready(trigger)
            try:
                async with asyncio.timeout(delay):  # not wait_for: on Python 3.11 it can lose a cancellation
                    await self._wake.wait()
                trigger = self._woken_at or time.monotonic()
            except TimeoutError:
                trigger = time.monotonic()

    def dispatch_ready(self, trigger: float) -> Optional[float]:
        """Dispatch everything eligible now; returns seconds until a rate limit or backoff may allow more.

        `trigger` is when the event that made this round necessary happened: a member's scheduling
        overhead is measured from max(when it became ready, trigger) to its POST on the wire."""
        now = time.monotonic()
        while not self.operator_paused:
            decision = self.scheduler.next(now, new_groups=self._new_groups_allowed)
            if decision is None:
                break
            if decision.member is None:
                self._start_group(decision.queue, now, trigger)
            else:
                group, member = decision.queue.pending.popleft()
                self._launch(decision.queue, group, member, now, trigger)
        self.metrics.queued.set(self.scheduler.queued)
        wake_in = self.scheduler.wake_in(now)
        if self.awaited_envs:  # re-check at the wait's end even if nothing else happens
            wait_end = max(0.0, self._await_until - now)
            wake_in = wait_end if wake_in is None else min(wake_in, wait_end)
        return wake_in

    def _new_groups_allowed(self, env: str) -> bool:
        limit = self.cfg.max_groups
        tasks = self.scheduler.queues[env].tasks
        return ((limit is None or self.counters.ordinal < limit) and not self._awaiting()
                and (tasks is None or tasks.has(self.counters.cursors.get(env, 0)))
                and not self.backpressure.reasons([env]))

    def _start_group(self, q: EnvQueue, now: float, trigger: float) -> None:
        cursor = self.counters.cursors.get(q.name, 0)
        self.counters.cursors[q.name] = cursor + 1
        self.counters.ordinal += 1
        group = Group.new(q.name, q.tasks[cursor], self.counters.ordinal, self.cfg.group_size, self.cfg.seed)
        self.add_group(group)
        for member in group.members:
            if q.free_slots(now) > 0:
                self._launch(q, group, member, now, trigger)
            else:  # an env with less capacity than a group: the rest waits for slots
                q.pending.append((group, member))
        self.ledger.touch(group)

    def _launch(self, q: EnvQueue, group: Group, member: Member, now: float, trigger: float) -> None:
        service = q.pick_service(now, avoid=member.service)
        member.ready_at = max(member.ready_at, trigger)
        member.state, member.attempt, member.service, member.session_id = MemberState.running, member.attempt + 1, \
            service.env_id, None
        member.incarnation = self.incarnation
        episode_id = group.episode_id(member)
        service.in_flight += 1
        q.in_flight += 1
        self.scheduler.charge(q, 1, now)
        self.metrics.in_flight.labels(q.name).inc()
        task = asyncio.create_task(self._attempt(group, member, service, episode_id), name=episode_id)
        self._attempts.add(task)
        task.add_done_callback(self._attempts.discard)
        self._running.setdefault(service.env_id, {})[episode_id] = (group, member, task)
        self.ledger.touch(group)

    def _release(self, service: Service, episode_id: str) -> bool:
        """Free the attempt's slot; False when it was already released (evacuated)."""
        if self._running.get(service.env_id, {}).pop(episode_id, None) is None:
            return False
        service.in_flight -= 1
        self.scheduler.queue(service.name).in_flight -= 1
        self.metrics.in_flight.labels(service.name).dec()
        self.wake()
        return True

    # One attempt ----------------------------------------------------------------------------------
    async def _attempt(self, group: Group, member: Member, service: Service, episode_id: str) -> None:
        started = time.monotonic()
        try:
            outcome = await self._play(group, member, service, episode_id)
        except asyncio.CancelledError:
            return  # evacuated (its state was handled there) or shutting down (state stays in Redis)
        except Exception as err:  # noqa: BLE001 - a bug must not leave the member running forever
            log.exception("episode %s: unexpected error", episode_id)
            outcome = Outcome("error", error=f"orchestrator: {err!r}", reason=ORCHESTRATOR_ERROR)
        if not self._release(service, episode_id):
            return
        seconds = time.monotonic() - started
        self.metrics.duration.labels(group.env).observe(seconds)
        if _ran_its_course(outcome):
            self.deadlines.observe(group.env, seconds)
            self.metrics.deadline.labels(group.env).set(self.deadlines.deadline_s(group.env))
        self.settling += 1
        try:
            await self._settle(group, member, service, outcome)
        except Exception:  # noqa: BLE001
            log.exception("episode %s: settling failed; running it again", episode_id)
            self._requeue(group, member, ORCHESTRATOR_ERROR, failure=True)
        finally:
            self.settling -= 1

    async def _play(self, group: Group, member: Member, service: Service, episode_id: str) -> Outcome:
        try:
            member.session_id, llm = await self.sessions.open(group, member, episode_id)
        except GatewayError as err:
            return Outcome("error", error=str(err), reason=ORCHESTRATOR_ERROR)
        self.ledger.touch(group)
        max_turns, deadline_s = self.episode_limits(service)
        request = EpisodeRequest(episode_id=episode_id, task_id=group.task_id, seed=member.seed, llm=llm,
                                 max_turns=max_turns, deadline_s=deadline_s)
        clock = SendClock(member.ready_at, self.metrics.dispatched)
        return await self.envs.run_episode(service.url, request, deadline_s + self.cfg.request_grace_s, clock)

    def episode_limits(self, service: Service) -> tuple[int, float]:
        """(max_turns, deadline_s) of an episode at `service`: its env's setting (`max_turns_by_env`,
        `episode_timeout_s_by_env`, by env name, else by domain), else the run's max_turns and the deadline
        sized from the env's episodes (orchestrator/deadlines.py)."""
        return self.max_turns(service.name, service.domain), self.deadline_s(service.name, service.domain)

    def max_turns(self, env: str, domain: str) -> int:
        return _by_env(self.cfg.max_turns_by_env, env, domain, self.cfg.max_turns)

    def deadline_s(self, env: str, domain: str) -> float:
        return _by_env(self.cfg.episode_timeout_s_by_env, env, domain, self.deadlines.deadline_s(env))

    async def _settle(self, group: Group, member: Member, service: Service, outcome: Outcome) -> None:
        response = outcome.response
        if response is not None and response.outcome is OutcomeClass.model:
            await self._record(group, member, response)
        elif outcome.kind == "refused":
            service.backoff_until = time.monotonic() + REFUSAL_BACKOFF_S
            self._abort_session(member.session_id)
            self._requeue(group, member, "refused", failure=False)
        else:
            reason, error = _failure(outcome)
            log.warning("episode %s on %s failed (%s): %s", group.episode_id(member), service.url, reason, error[:300])
            if outcome.unreachable:  # do not wait for missed heartbeats to stop sending it work
                self.unhealthy(service, "unreachable")
            await self._fail(group, member, reason, error)

    async def _record(self, group: Group, member: Member, response: EpisodeResponse) -> None:
        await self.ledger.durable(group)  # the session id is in Redis before the session is recorded
        info = {"num_turns": response.num_turns, **response.info, "outcome": response.outcome.value,
                "reason": response.reason.value}
        finished = await self.sessions.finish(member.session_id, response.status.value, response.reward, info)
        if finished.status == "aborted":  # the gateway lost the session: nothing was recorded
            self._requeue(group, member, "session_lost", failure=False)
            return
        member.reward, member.num_turns = response.reward, response.num_turns
        self.metrics.reward.labels(group.env).observe(response.reward)
        self._count_outcome(group.env, response.reason.value)
        self._finish_member(group, member, MemberState.done, response.status.value, finished.sample_refs)

    async def _fail(self, group: Group, member: Member, reason: str, error: str) -> None:
        """A failed attempt (`reason` of orchestrator/outcomes.py): run it again, or after max_attempts
        give the member up with a "failed" session that says why (the trainer drops it)."""
        if member.failures + 1 < self.cfg.max_attempts:
            self._abort_session(member.session_id)
            self._requeue(group, member, reason, failure=True)
            return
        member.failures += 1
        self._count_outcome(group.env, reason)
        await self.ledger.durable(group)
        info: dict[str, Any] = {"error": error[:2000], "attempts": member.attempt,
                                "outcome": outcome_class(reason).value, "reason": reason}
        finished = await self.sessions.finish(member.session_id, "failed", 0.0, info) if member.session_id else None
        log.error("episode %s given up after %d failures: %s", group.episode_id(member), member.failures, error[:300])
        self._finish_member(group, member, MemberState.given_up, "failed", finished.sample_refs if finished else [])

    def _abort_session(self, session_id: Optional[str]) -> None:
        """Close a session that will not be used (in the background: the retry does not wait for it)."""
        if session_id is not None:
            self.spawn(self.sessions.finish(session_id, "aborted"))

    def _requeue(self, group: Group, member: Member, reason: str, failure: bool) -> None:
        member.failures += int(failure)
        if failure:
            self._count_outcome(group.env, reason)
        member.state, member.session_id, member.ready_at = MemberState.pending, None, time.monotonic()
        self.scheduler.queue(group.env).pending.append((group, member))
        self.counters.retried += 1
        self.metrics.retries.labels(group.env, reason).inc()
        self.ledger.touch(group)
        self.wake()

    def _count_outcome(self, env: str, reason: str) -> None:
        self.counters.outcomes[env][reason] += 1
        self.metrics.outcomes.labels(env, outcome_class(reason).value, reason).inc()

    def _finish_member(self, group: Group, member: Member, state: MemberState, status: str, refs: list[str]) -> None:
        member.state, member.status, member.sample_refs = state, status, list(refs)
        env = self.counters.by_env[group.env]
        env["completed" if state is MemberState.done else "failed"] += 1
        self.metrics.episodes.labels(group.env, status if state is MemberState.done else "given_up").inc()
        self.metrics.finished(time.monotonic())
        if group.complete:
            self.complete_group(group)
        else:
            self.ledger.touch(group)

    def complete_group(self, group: Group) -> None:
        """Every member finished: append the group's record, or filter it (dynamic sampling)."""
        del self.groups[group.group_id]
        self.open_by_env[group.env] -= 1
        env = self.counters.by_env[group.env]
        verdict, filtered, self.counters.filter_streak = self.sampler.decide(group, self.counters.filter_streak)
        self.metrics.filtered_fraction.set(self.sampler.filtered_fraction)
        if filtered:
            env["filtered"] += 1
            self.metrics.filtered.labels(group.env).inc()
            self.ledger.discard(group)
            self.wake()  # its place under the staleness budget is free again
            return
        if verdict is Verdict.unusable:
            env["unusable"] += 1
            if self.sampler.enabled:
                self.wake()  # not counted under the staleness budget: a place is free
        elif verdict is Verdict.uninformative and self.sampler.enabled:
            env["passed"] += 1
            self.metrics.passed.labels(group.env).inc()
        env["groups"] += 1
        self.metrics.groups.labels(group.env).inc()
        self.ledger.complete(group)

    # Services ------------------------------------------------------------------------------------
    async def register(self, req: RegisterRequest) -> Service:
        service, created = self.registry.register(req)
        await self.ledger.save_service(service)
        self.scheduler.add_service(service, time.monotonic())
        self.metrics.healthy.labels(service.name).set(self.scheduler.queue(service.name).healthy_services())
        log.info("%s env %s (%s) at %s: capacity %d, weight %g, heartbeat %s", "registered" if created else
                 "re-registered", service.name, service.env_id, service.url, service.capacity, service.weight,
                 service.heartbeat)
        self.wake()
        return service

    def heartbeat(self, env_id: str, beat: HeartbeatRequest) -> Optional[Service]:
        service = self.registry.get(env_id)
        if service is None:
            return None
        service.reported_in_flight = beat.in_flight
        if beat.healthy:
            self.alive(service)
        else:
            self.unhealthy(service, "the service reported itself unhealthy")
        return service

    def alive(self, service: Service) -> None:
        recovered = not service.healthy
        self.registry.mark_alive(service)
        self.ledger.heartbeat(service.env_id, service.last_heartbeat)
        if recovered:
            log.info("env %s (%s) at %s is healthy again", service.name, service.env_id, service.url)
            self._services_changed(service)

    def unhealthy(self, service: Service, why: str) -> None:
        """Out of the rotation; its running episodes are re-dispatched (a failure each)."""
        if not service.healthy:
            return
        service.healthy = False
        running = self._running.get(service.env_id, {})
        log.warning("env %s (%s) at %s unhealthy (%s): re-dispatching its %d running episodes", service.name,
                    service.env_id, service.url, why, len(running))
        self.evacuate(service, why)
        self._services_changed(service)

    def evacuate(self, service: Service, why: str) -> None:
        for episode_id, (group, member, task) in list(self._running.get(service.env_id, {}).items()):
            task.cancel()
            self._release(service, episode_id)
            self.spawn(self.envs.cancel(service.url, episode_id))
            self.spawn(self._fail(group, member, SERVICE_ERROR, f"{service.url} unhealthy: {why}"))

    async def remove(self, env_id: str) -> Optional[tuple[Service, int]]:
        """Deregister: nothing new goes there; its running episodes finish and count."""
        service = self.registry.get(env_id)
        if service is None:
            return None
        service.removed = True
        self.registry.forget(service)
        self.scheduler.remove_service(service)
        await self.ledger.delete_service(env_id)
        draining = len(self._running.get(env_id, {}))
        log.info("removed env %s (%s) at %s; %d episodes draining", service.name, env_id, service.url, draining)
        self._services_changed(service)
        return service, draining

    def _services_changed(self, service: Service) -> None:
        q = self.scheduler.queues.get(service.name)
        self.metrics.healthy.labels(service.name).set(q.healthy_services() if q else 0)
        self.wake()

    # Control -------------------------------------------------------------------------------------
    def pause(self, paused: bool) -> PauseResponse:
        """The operator holds (or releases) dispatch; backpressure may still hold it."""
        self.operator_paused = paused
        log.info("dispatch %s by the operator", "paused" if paused else "resumed")
        self.wake()
        return PauseResponse(paused=bool(self.pause_reasons), pause_reasons=self.pause_reasons)

    def status(self, overhead_since: Optional[float] = None) -> StatusResponse:
        """`overhead_since`: unix time from which dispatch overheads are summarised (default: the rate window)."""
        if overhead_since is None:
            overhead_since = time.time() - self.cfg.rate_window_s
        by_env = {}
        open_groups = self.open_by_env
        for name, q in self.scheduler.queues.items():
            c = self.counters.by_env[name]
            by_env[name] = EnvStatus(in_flight=q.in_flight, queued=len(q.pending),
                                     completed=c["completed"], failed=c["failed"], groups_completed=c["groups"],
                                     groups_filtered=c["filtered"], groups_passed=c["passed"],
                                     groups_unusable=c["unusable"],
                                     healthy_services=q.healthy_services(), weight=q.weight,
                                     groups_open=open_groups.get(name, 0), held=self.backpressure.reasons([name]),
                                     deadline_s=self.deadline_s(name, q.domain), max_turns=self.max_turns(name, q.domain),
                                     outcomes=by_class(self.counters.outcomes[name]))
        return StatusResponse(
            in_flight=self.scheduler.in_flight, settling=self.settling, queued=self.scheduler.queued,
            completed=self.counters.total("completed"), failed=self.counters.total("failed"),
            retried=self.counters.retried, groups_completed=self.counters.total("groups"),
            groups_recorded=self.counters.total("groups") - self.ledger.unwritten_completions,
            groups_lost_to_redis=self.ledger.records_lost,
            groups_open=len(self.groups), groups_filtered=self.counters.total("filtered"),
            groups_passed=self.counters.total("passed"), groups_unusable=self.counters.total("unusable"),
            filtered_fraction=self.sampler.filtered_fraction, filter_streak=self.counters.filter_streak,
            episodes_per_s=self.metrics.episodes_per_s(self.cfg.rate_window_s),
            weight_version=self.backpressure.served_version, paused=bool(self.pause_reasons),
            pause_reasons=self.pause_reasons, dispatch_overhead=OverheadSummary(**self.metrics.overhead_summary(overhead_since)),
            outcomes=by_class(self.counters.total_outcomes()), by_env=by_env)

    async def close(self) -> None:
        """Stop attempts, settling ones included (their state stays in Redis for the next start, which finishes a
        half-recorded session idempotently: orchestrator/recovery.py), then close the clients."""
        tasks = list(self._attempts) + list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.sessions.close()
        await self.http.close()


def _by_env(by_env: dict, env: str, domain: str, default):
    """An env's entry of a by-env setting: by its name, else by its domain, else `default`."""
    return by_env.get(env, by_env.get(domain, default))


def _ran_its_course(outcome: Outcome) -> bool:
    """An attempt whose length says how long the env's episodes take: a model outcome, or cut at its deadline."""
    response = outcome.response
    return response is not None and (response.outcome is OutcomeClass.model
                                     or response.reason is EpisodeReason.deadline_exceeded)


def _failure(outcome: Outcome) -> tuple[str, str]:
    """(reason, what broke) of an attempt that did not end in a model outcome."""
    response = outcome.response
    if response is None:
        return outcome.reason, outcome.error
    if response.outcome is OutcomeClass.cancelled:  # never one the orchestrator cancelled: those are not settled
        return SERVICE_ERROR, "the env service aborted the episode (draining, or cancelled there)"
    return response.reason.value, str(response.info.get("error", ""))
