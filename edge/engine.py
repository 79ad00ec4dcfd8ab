"""The device agent's protocol logic (docs/protocol.md, v1) as a pure state machine, as h11 is for HTTP.

`AgentEngine.handle(event, now)` takes what happened (a connect, an MQTT message, a tick, or the result of a
job it asked for) and returns what to do: messages to publish and jobs for the service (check the
`--only-when` conditions, train a round, evaluate the final model), whose results come back as events. It
opens no file, trains nothing and imports no MQTT client (tests/test_architecture.py), so the service's loop
never waits on training and tests drive it with hand-built frames and fake results. Where the device stands
is one `Phase`; `TRANSITIONS` is the one place a transition is decided. docs/architecture.md draws the
machine; docs/protocol.md (sections 8 and 8.1) says what a device does and refuses.

Durability: the train job saves the trained state (edge/state.py) before it returns its result, so an update
this engine publishes is always on disk already; saving is the job's last step, not a separate action. The one
I/O under this engine is secure aggregation's participant (edge/secure_round.py, made by the shell's factory):
it loads the device's identity and records a round it revealed shares in before the shares leave.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np

from fedper.compression import DELTA_CODECS
from fedper.manifest import Manifest
from fedper.payload import decode_shared, encode_shared, max_blob_size
from fedper.wire import (
    DEFAULT_CHUNK_SIZE,
    SECAGG_CODEC,
    SECAGG_DOWN,
    Blob,
    ErrorMessage,
    Invitation,
    Outgoing,
    Reassembler,
    Register,
    RoundInfo,
    Topics,
    UpdateMeta,
    WireError,
    chunk,
    decode_chunk,
    decode_secagg,
)

if TYPE_CHECKING:
    from fedper.edge.secure_round import SecureParticipant

    # The participant in the secure session RoundInfo names, for the saved update (and meta) of that round
    SecureFactory = Callable[[RoundInfo, "Saved", Mapping[str, np.ndarray], UpdateMeta], SecureParticipant]

SOFTWARE = "fedper-agent/0.1.0"
COORDINATOR = "coordinator"  # the one source of model chunks
MAX_NOTED_BLOBS = 64  # blob ids whose refusal was logged (one line per blob, not per chunk)


class AgentError(RuntimeError):
    """The agent cannot go on (bad input, another export's coordinator); the message says why."""


@dataclass
class Saved:
    """A trained round, as the train job returns it and device.safetensors keeps it (edge/state.py)."""

    round: int
    base_digest: str
    n_samples: int
    local: dict[str, np.ndarray]  # device-local tensors (the head)
    update: dict[str, np.ndarray]  # the shared tensors this device sent for `round`
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineSettings:
    client_id: str
    fleet: str
    n_samples: int  # the training-sample count this device registers (n_j)
    chunk_size: int = DEFAULT_CHUNK_SIZE
    compression: str = "fp32"  # update codec: one of fedper.compression.CODECS
    secure_aggregation: bool = False  # never send the update in the clear: only under a SecAgg+ session
    conditions: bool = False  # --only-when given: ask the service to check it before taking part
    recheck_s: float = 60.0  # while not eligible, check the conditions again after this long


# ------------------------------------------------------------ what goes in, what comes out


@dataclass(frozen=True)
class Connected:
    """(Re)connected to the broker."""


@dataclass(frozen=True)
class Message:
    topic: str
    payload: bytes


@dataclass(frozen=True)
class Tick:
    """Time passed without a message (the service sends one every fraction of a second)."""


@dataclass(frozen=True)
class CheckConditions:
    """Job: check --only-when (for `round`, 0 when no round is known), answered with ConditionsChecked."""

    round: int


@dataclass(frozen=True)
class TrainRound:
    """Job: load `model` (the round's shared tensors), evaluate, train the phases and save the state,
    answered with RoundTrained."""

    info: RoundInfo
    model: Mapping[str, np.ndarray] = field(repr=False)


@dataclass(frozen=True)
class EvaluateFinal:
    """Job: load the final `model`, evaluate what the device serves and save it, answered with FinalEvaluated."""

    info: RoundInfo
    model: Mapping[str, np.ndarray] = field(repr=False)


@dataclass(frozen=True)
class ConditionsChecked:
    job: CheckConditions
    problem: str | None  # None: every condition holds


@dataclass(frozen=True)
class RoundTrained:
    job: TrainRound
    saved: Saved  # already on disk


@dataclass(frozen=True)
class FinalEvaluated:
    job: EvaluateFinal
    accuracy: float


Job = CheckConditions | TrainRound | EvaluateFinal
Result = ConditionsChecked | RoundTrained | FinalEvaluated
Action = Outgoing | Job
Input = Connected | Message | Tick | Result


# ------------------------------------------------------------ the machine


class Phase(Enum):
    IDLE = "idle"  # no part in the open round: none known, not invited, or not eligible
    CHECKING = "checking"  # a CheckConditions job is out
    DOWNLOADING = "downloading"  # taking part: waiting for the round's model, to train on it
    RESENDING = "resending"  # the open round is the one the saved update answers: waiting for its model to resend
    TRAINING = "training"  # a TrainRound job is out
    ANSWERED = "answered"  # the update (or the secure-aggregation keys) went out; a re-published RoundInfo resends
    FINAL_DOWNLOAD = "final download"  # the run is finished: waiting for the final model
    EVALUATING = "evaluating"  # an EvaluateFinal job is out
    DONE = "done"  # the final model is evaluated and saved: the agent stops


class Event(Enum):
    # what the open round asks of this device (a RoundInfo, or DECIDE looking again)
    NOT_ASKED = "not asked"  # no round known, or an open round that invites others
    UNCHECKED = "unchecked"  # a round to take part in, --only-when not yet checked for it
    INELIGIBLE = "ineligible"  # a round to take part in, --only-when failed (backing off)
    ROUND_OPEN = "round open"  # a round to train for
    ROUND_ANSWERED = "round answered"  # the open round is the one the saved update answers
    FINISHED = "finished"  # the run is over: the final model is announced
    # messages and time
    CONNECTED = "connected"
    INVITED = "invited"  # an invitation to the open round
    UNINVITED = "uninvited"  # the open round's invitation was cleared
    BLOB = "blob"  # a model blob is complete
    RESEND = "resend"  # the coordinator has lost the saved update (unknown_device, bad_chunk)
    RESEND_STALE = "resend stale"  # asynchronous rounds: RoundInfo came again while the saved update, of an earlier
    # round the coordinator still takes, may have been lost (a restart or a reconnect of either side)
    RECHECK = "recheck"  # the back-off after failed conditions is over
    MODEL = "model"  # the model the phase waits for is here, decoded and checked
    # job results
    CHECKED = "checked"
    TRAINED = "trained"
    TRAINED_LATE = "trained late"  # trained, but the open round moved on meanwhile
    EVALUATED = "evaluated"


class Step(Enum):
    ANNOUNCE = "announce"  # publish presence and Register
    CHECK = "check"  # a CheckConditions job (with no --only-when: eligible at once)
    DECIDE = "decide"  # look at what the open round asks now: one of the first six events follows
    FETCH = "fetch"  # MODEL follows if the model is here; the subscriptions ask for it otherwise
    TRAIN = "train"  # a TrainRound job
    SEND = "send"  # the update just trained: in the clear, or keys for the secure session
    SEND_AGAIN = "send again"  # the saved update, again
    SEND_STALE = "send stale"  # the saved update of an earlier round, again, encoded against that round's model
    EVALUATE = "evaluate"  # an EvaluateFinal job


P, E, S = Phase, Event, Step
WAITING = (P.IDLE, P.DOWNLOADING, P.RESENDING, P.ANSWERED, P.FINAL_DOWNLOAD)  # waiting on a message
BUSY = (P.CHECKING, P.TRAINING, P.EVALUATING)  # a job is out: what changes meanwhile is decided when it returns
FETCHING = (P.DOWNLOADING, P.RESENDING, P.FINAL_DOWNLOAD)  # the subscriptions ask for the round's model
FOLLOW = {  # a phase waiting on a message follows what the open round asks
    E.NOT_ASKED: (P.IDLE, ()),
    E.INELIGIBLE: (P.IDLE, ()),
    E.UNCHECKED: (P.CHECKING, (S.CHECK,)),
    E.ROUND_OPEN: (P.DOWNLOADING, (S.FETCH,)),
    E.ROUND_ANSWERED: (P.RESENDING, (S.FETCH,)),
    E.FINISHED: (P.FINAL_DOWNLOAD, (S.FETCH,)),
}
# (phase, event) -> (next phase, steps in order). A pair not listed changes nothing (a busy phase holds what
# comes meanwhile; DONE ignores everything). A step that may lead to another event comes last in its row.
TRANSITIONS: dict[tuple[Phase, Event], tuple[Phase, tuple[Step, ...]]] = {
    **{(phase, event): row for phase in WAITING for event, row in FOLLOW.items()},
    **{(phase, E.CONNECTED): (phase, (S.ANNOUNCE,)) for phase in (*WAITING, *BUSY) if phase is not P.IDLE},
    (P.IDLE, E.CONNECTED): (P.CHECKING, (S.ANNOUNCE, S.CHECK)),  # presence with a fresh verdict
    (P.IDLE, E.RECHECK): (P.CHECKING, (S.CHECK,)),
    (P.IDLE, E.INVITED): (P.IDLE, (S.DECIDE,)),
    (P.DOWNLOADING, E.UNINVITED): (P.IDLE, ()),
    (P.RESENDING, E.UNINVITED): (P.IDLE, ()),
    **{(phase, E.BLOB): (phase, (S.FETCH,)) for phase in FETCHING},
    (P.DOWNLOADING, E.MODEL): (P.TRAINING, (S.TRAIN,)),
    (P.RESENDING, E.MODEL): (P.ANSWERED, (S.SEND_AGAIN,)),
    (P.FINAL_DOWNLOAD, E.MODEL): (P.EVALUATING, (S.EVALUATE,)),
    **{(phase, E.RESEND): (phase, (S.ANNOUNCE, S.DECIDE)) for phase in WAITING},
    **{(phase, E.RESEND): (phase, (S.ANNOUNCE,)) for phase in BUSY},
    **{(phase, E.RESEND_STALE): (phase, (S.SEND_STALE,)) for phase in WAITING},
    (P.CHECKING, E.CHECKED): (P.IDLE, (S.DECIDE,)),
    (P.TRAINING, E.TRAINED): (P.ANSWERED, (S.SEND,)),
    (P.TRAINING, E.TRAINED_LATE): (P.ANSWERED, (S.SEND, S.DECIDE)),
    (P.EVALUATING, E.EVALUATED): (P.DONE, ()),
}


@dataclass(frozen=True)
class RoundModel:
    """A round's base model, decoded and checked once; keyed by what RoundInfo names it by."""

    blob_id: str
    sha256: str
    tensors: Mapping[str, np.ndarray]


class AgentEngine:
    """One FedPer participant's side of the protocol: what it knows of the coordinator's rounds, its saved
    update and its eligibility; `saved` is the last trained round (from the state directory at start)."""

    def __init__(self, manifest: Manifest, settings: EngineSettings, saved: Saved | None = None,
                 log: Callable[[str], None] = print, secure: SecureFactory | None = None) -> None:
        self.manifest, self.settings, self.saved, self.log = manifest, settings, saved, log
        self._make_secure = secure  # None: this device takes part in no secure session
        self.topics = Topics(settings.fleet)
        self.phase = Phase.IDLE
        self.final_accuracy: float | None = None
        self._steps = {S.ANNOUNCE: self._announce, S.CHECK: self._check, S.DECIDE: self._decide,
                       S.FETCH: self._fetch, S.TRAIN: self._train, S.SEND: self._send,
                       S.SEND_AGAIN: self._send_again, S.SEND_STALE: self._send_stale, S.EVALUATE: self._evaluate}
        self._now = 0.0
        self._models = Reassembler(max_blob_size(manifest), max_open_blobs=4)
        self._blob: Blob | None = None  # the newest complete model blob, until a RoundInfo names it
        self._model: RoundModel | None = None  # the open round's model, decoded
        self._round: RoundInfo | None = None  # the newest RoundInfo that passed its checks
        self._training: TrainRound | None = None  # the train job out, until its update is sent
        self._kept: TrainRound | None = None  # asynchronous rounds: the job of the update sent last (its model)
        self._invited: int | None = None  # the round of this device's newest invitation
        self._eligible = not settings.conditions  # the conditions' last verdict: offline until first checked
        self._accepted: int | None = None  # the round the conditions were found to hold for: not checked again
        self._recheck_at: float | None = None  # while not eligible: when to check again
        self._secure: SecureParticipant | None = None  # the secure-aggregation session this device is in
        self._noted: set[str] = set()  # blob ids refused and logged once
        self._quiet: int | None = None  # the round whose "not invited" was logged
        self._declined: int | None = None  # the round whose "not eligible" was logged
        self._clear_refused: int | None = None  # the round whose clear update --secure-aggregation held back

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    def handle(self, event: Input, now: float) -> list[Action]:
        """One event (`now`: unix seconds); what to publish and which jobs to run. AgentError when the agent
        cannot go on."""
        self._now = now
        match event:
            case Message(topic, payload):
                return self._on_message(topic, payload)
            case Tick():
                due = not self._eligible and (self._recheck_at is None or now >= self._recheck_at)
                return self._step(E.RECHECK) if due else []
            case Connected():
                self.log("connected")
                self._recheck_at = None  # a connect is a reason to look at the conditions again
                return self._step(E.CONNECTED)
            case ConditionsChecked(job, problem):
                return self._on_checked(job, problem)
            case RoundTrained(job, saved):
                self.saved = saved
                info = self._round
                moved_on = info is None or info.state != "open" or info.round != job.info.round
                return self._step(E.TRAINED_LATE if moved_on else E.TRAINED)
            case FinalEvaluated(_, accuracy):
                self.final_accuracy = accuracy
                return self._step(E.EVALUATED)
        raise TypeError(f"not an engine input: {event!r}")

    def _step(self, event: Event) -> list[Action]:
        """The table's row for (phase, event): move to its phase, run its steps."""
        self.phase, steps = TRANSITIONS.get((self.phase, event), (self.phase, ()))
        out: list[Action] = []
        for step in steps:
            out += self._steps[step]()
        return out

    def _situation(self) -> Event:
        """What the open round asks of this device now (the conditions are checked once per round: a round
        under way is not dropped midway)."""
        info = self._round
        if info is None or (info.state == "open" and not self._invited_to(info)):
            return E.NOT_ASKED
        if info.state == "finished":
            return E.FINISHED
        if self.settings.conditions and self._accepted != info.round:
            backing_off = self._recheck_at is not None and self._now < self._recheck_at
            return E.INELIGIBLE if backing_off else E.UNCHECKED
        answered = self.saved is not None and self.saved.round == info.round
        return E.ROUND_ANSWERED if answered else E.ROUND_OPEN

    # ------------------------------------------------------------ subscriptions

    def subscriptions(self) -> list[tuple[str, int]]:
        """What to be subscribed to now: RoundInfo, its errors and its invitations always; the relay of secure
        aggregation when it is on; the model's chunks once RoundInfo says which (with selection: only while
        this device waits for the model)."""
        t, me = self.topics, self.settings.client_id
        wanted = [(t.round, 1), (t.error(me), 1), (t.invite(me), 1)]
        info = self._round
        if self.settings.secure_aggregation or (info is not None and info.secagg_session is not None):
            wanted.append((t.relay(me), 1))  # the coordinator's secure-aggregation stages
        if info is not None and info.selection == "all":
            wanted.append((self.all_models_topic, 1))
        elif info is not None and self.phase in FETCHING and not self._holds_model(info):
            wanted.append((f"{t.base}/model/{info.blob_id}/#", 1))
        return wanted

    @property
    def all_models_topic(self) -> str:
        return f"{self.topics.base}/model/#"

    # ------------------------------------------------------------ messages in

    def _on_message(self, topic: str, payload: bytes) -> list[Action]:
        t, me = self.topics, self.settings.client_id
        try:
            if topic == t.round:
                return self._on_round_info(RoundInfo.decode(payload))
            if topic.startswith(f"{t.base}/model/"):
                return self._on_model_chunk(topic, payload)
            if topic == t.error(me):
                return self._on_error(ErrorMessage.decode(payload))
            if topic == t.invite(me):
                return self._on_invitation(payload)
            if topic == t.relay(me):
                return self._on_relay(payload)
        except WireError as e:
            self.log(f"ignored a bad message on {topic}: {e}")
        return []

    def _on_round_info(self, info: RoundInfo) -> list[Action]:
        problem = self._round_info_problem(info)
        if problem:
            self.log(f"ignored RoundInfo of round {info.round} ({info.state}): {problem}")
            return []
        again = self._round is None or self._round.round == info.round  # (re)published, or the first seen
        self._round = info
        self._recheck_at = None  # a RoundInfo is a reason to look at the conditions again
        if info.state == "open" and not self._invited_to(info) and self._quiet != info.round:
            self._quiet = info.round
            wait = (info.next_selection_at or info.deadline) - self._now
            self.log(f"round {info.round}: not invited; quiet until an invitation or the next selection "
                     f"(due within {max(wait, 0):.0f} s)")
        # No update is acknowledged in v1: one sent while the coordinator or the broker was away may be
        # lost, so the saved update goes again whenever its round's RoundInfo is (re)published (after a
        # reconnect, a restart or an extension); the coordinator answers duplicate_update if it had it.
        # Asynchronous rounds take the saved update of an earlier round too: it goes again on the same occasions.
        stale = self._step(E.RESEND_STALE) if again and self._lost_stale(info) else []
        return stale + self._step(self._situation())

    def _lost_stale(self, info: RoundInfo) -> bool:
        """Whether the saved update is of an earlier round that `info` (asynchronous: max_staleness) still takes,
        and can be encoded again (a delta codec needs the model it was trained on, kept in memory only)."""
        saved = self.saved
        if info.state != "open" or info.max_staleness is None or saved is None:
            return False
        if not info.round - info.max_staleness <= saved.round < info.round:
            return False
        kept = self._kept is not None and self._kept.info.round == saved.round
        return kept or self.settings.compression not in DELTA_CODECS

    def _round_info_problem(self, info: RoundInfo) -> str | None:
        if info.base_digest != self.manifest.base_digest:
            return f"it is for another export (base_digest {info.base_digest}, ours {self.manifest.base_digest})"
        if info.round > info.rounds:
            return f"round {info.round} of a run of {info.rounds} rounds"
        if info.size > self._models.max_blob_size:
            return (f"its model declares {info.size} bytes, more than this model's shared tensors take "
                    f"({self._models.max_blob_size})")
        answered = max(self.saved.round if self.saved else 0, self._training.info.round if self._training else 0)
        if info.state == "open" and info.round < answered:
            return f"stale: this device already answered round {answered}"
        if info.lr is not None and not info.lr > 0:
            return f"its learning rate {info.lr} is not > 0"
        return None

    def _on_invitation(self, payload: bytes) -> list[Action]:
        info = self._round
        if not payload:  # cleared: its round closed
            self._invited = None
            withdrawn = info is not None and info.state == "open" and not self._invited_to(info)
            return self._step(E.UNINVITED) if withdrawn else []
        invitation = Invitation.decode(payload)
        self._invited = invitation.round
        if info is not None and info.round == invitation.round:
            self.log(f"round {info.round}: invited")
            self._recheck_at = None
            return self._step(E.INVITED)
        return []  # for another round: acted on once RoundInfo opens it

    def _invited_to(self, info: RoundInfo) -> bool:
        return info.selection == "all" or self._invited == info.round

    def _on_model_chunk(self, topic: str, payload: bytes) -> list[Action]:
        if not payload:  # an empty retained payload clears an old round's chunk
            return []
        where = topic[len(f"{self.topics.base}/model/"):].split("/")
        try:
            piece = decode_chunk(payload, max_blob_size=self._models.max_blob_size)
            if where != [piece.blob_id, str(piece.index)]:
                raise WireError("bad_chunk", f"chunk {piece.index} of blob {piece.blob_id} on another blob's topic")
            blob = self._models.add(COORDINATOR, piece)
        except WireError as e:
            self._refuse_blob(where[0], f"ignored a bad model chunk on {topic}: {e}")
            return []
        if blob is None:
            return []
        self._noted.discard(blob.blob_id)
        info = self._round
        if info is not None and blob.blob_id == info.blob_id and blob.sha256 != info.sha256:
            self._refuse_blob(blob.blob_id, f"model {blob.blob_id} does not match the round's sha256: "
                              "waiting for the right one")
            return []
        self._blob = blob  # only the newest model is worth keeping
        return self._step(E.BLOB)

    def _refuse_blob(self, blob_id: str, line: str) -> None:
        """Log a refused model blob once, however many of its chunks arrive."""
        if blob_id in self._noted:
            return
        if len(self._noted) >= MAX_NOTED_BLOBS:
            self._noted.clear()
        self._noted.add(blob_id)
        self.log(line)

    def _on_error(self, error: ErrorMessage) -> list[Action]:
        self.log(f"coordinator: {error.code}: {error.message}")
        if error.code == "digest_mismatch":
            raise AgentError(f"the coordinator refused this export: {error.message}")
        if error.code in ("unknown_device", "bad_chunk") and self.saved and error.round == self.saved.round:
            return self._step(E.RESEND)  # register again, then send the update again (a fresh blob id)
        return []

    def _on_relay(self, payload: bytes) -> list[Action]:
        """A secure-aggregation stage message from the coordinator, for the session this device is in."""
        message = decode_secagg(payload, SECAGG_DOWN)
        secure = self._secure
        if secure is None:
            self.log(f"ignored a secure-aggregation {message.stage} message: this device is in no session")
            return []
        try:
            out = secure.handle(message)
        except Exception as e:  # untrusted input (SecAggError, or the kernel's and numpy's ValueError): a refusal
            self.log(f"round {secure.round}: refused the coordinator's secure-aggregation {message.stage} message "
                     f"({type(e).__name__}: {e}); nothing sent for it")
            return []
        from fedper.edge.secure_round import SENT

        self.log(f"round {secure.round}: secure aggregation session {secure.session}: {SENT[message.stage]}")
        return list(out)

    def _on_checked(self, job: CheckConditions, problem: str | None) -> list[Action]:
        """Record a verdict on --only-when: log why not once per round, publish presence if it changed."""
        was, where = self._eligible, f"round {job.round}: " if job.round else ""
        self._eligible = problem is None
        info = self._round
        if problem is None:
            self._recheck_at = None
            if self._declined is not None:
                self.log(f"{where}eligible again")
                self._declined = None
            if info is not None and info.round == job.round and info.state == "open" and self._invited_to(info):
                self._accepted = job.round
        else:
            self._recheck_at = self._now + self.settings.recheck_s
            if self._declined != job.round:
                self._declined = job.round
                self.log(f"{where}not eligible ({problem}): not taking part; checking again in "
                         f"{self.settings.recheck_s:g} s")
        presence: list[Action] = [self._presence()] if self._eligible != was else []
        return presence + self._step(E.CHECKED)

    # ------------------------------------------------------------ steps

    def _announce(self) -> list[Action]:
        """Say whether we are online (willing to train) and (re-)register, on every connect, as docs/protocol.md
        asks. The subscription then delivers the retained RoundInfo, which resends an unacknowledged update."""
        register = Register(n_samples=self.settings.n_samples, base_digest=self.manifest.base_digest,
                            software=SOFTWARE)
        return [self._presence(), Outgoing(self.topics.register(self.settings.client_id), register.encode(),
                                           retain=True)]

    def _presence(self) -> Outgoing:
        """`online` while the device is willing to train (a selecting coordinator invites only those)."""
        return Outgoing(self.topics.presence(self.settings.client_id), b"online" if self._eligible else b"offline",
                        retain=True)

    def _check(self) -> list[Action]:
        job = CheckConditions(self._round.round if self._round else 0)
        return [job] if self.settings.conditions else self._on_checked(job, None)

    def _decide(self) -> list[Action]:
        return self._step(self._situation())

    def _fetch(self) -> list[Action]:
        return self._step(E.MODEL) if self._round_model() is not None else []

    def _round_model(self) -> Mapping[str, np.ndarray] | None:
        """The model RoundInfo names, decoded once and checked; None while it is not here (or refused)."""
        info = self._round
        assert info is not None
        if self._holds_model(info):
            return self._model.tensors
        blob = self._blob
        if blob is None or blob.blob_id != info.blob_id:
            return None
        if blob.sha256 != info.sha256:  # kept: the RoundInfo may be the forged one
            self.log(f"model {info.blob_id} does not match the round's sha256: waiting for the right one")
            return None
        self._blob = None
        self._model = None  # the last round's model is done with: never hold two decoded models
        try:
            tensors = decode_shared(self.manifest, blob.data, codec="fp32")  # a round's model is always fp32
        except Exception as e:  # an untrusted blob: whatever fails in decoding it is a refusal, not a crash
            self.log(f"refused model {info.blob_id} of round {info.round}: {type(e).__name__}: {e}")
            return None
        self._model = RoundModel(info.blob_id, info.sha256, tensors)
        return tensors

    def _holds_model(self, info: RoundInfo) -> bool:
        """Decoded and checked: a blob that came under the round's id but failed is no reason to stop listening."""
        return self._model is not None and (self._model.blob_id, self._model.sha256) == (info.blob_id, info.sha256)

    def _train(self) -> list[Action]:
        assert self._round is not None and self._model is not None
        self._training = TrainRound(self._round, self._model.tensors)
        return [self._training]

    def _evaluate(self) -> list[Action]:
        assert self._round is not None and self._model is not None
        return [EvaluateFinal(self._round, self._model.tensors)]

    def _send(self) -> list[Action]:
        """Answer the round just trained for: its RoundInfo now if still open (a re-publication may name a new
        secure session), else the one it was trained under (the update goes all the same, as it always has)."""
        job, info = self._training, self._round
        assert job is not None and self.saved is not None
        self._training = None
        if info is None or info.state != "open" or info.round != job.info.round:
            if info is not None and info.state == "open" and info.max_staleness is not None and \
                    job.info.round < info.round - info.max_staleness:
                self.log(f"round {job.info.round}: trained, but round {info.round} is open and takes updates of "
                         f"rounds {info.round - info.max_staleness} on: not sent")
                return []
            info = job.info
        self._kept = job if job.info.max_staleness is not None else None  # a resend may need its model
        return self._answer(info, job.model)

    def _send_again(self) -> list[Action]:
        assert self._round is not None and self._model is not None
        self.log(f"round {self._round.round}: already trained (before a restart, a reconnect or the round's "
                 "re-publication), sending the saved update again")
        return self._answer(self._round, self._model.tensors)

    def _send_stale(self) -> list[Action]:
        saved, kept = self.saved, self._kept
        assert saved is not None and self._round is not None
        self.log(f"round {self._round.round}: sending the saved update of round {saved.round} again (asynchronous "
                 "rounds still take it; it may have been lost)")
        return self._update(kept.model if kept is not None and kept.info.round == saved.round else {})

    def _answer(self, info: RoundInfo, model: Mapping[str, np.ndarray]) -> list[Action]:
        """The saved update for `info`'s round, whose model is `model`: keys for its secure session, or the update
        in the clear unless --secure-aggregation holds it back."""
        if info.secagg_session is not None:
            return self._secure_advert(info, model)
        if self.settings.secure_aggregation:
            if self._clear_refused != info.round:
                self._clear_refused = info.round
                self.log(f"round {info.round}: the coordinator asks for a clear update; --secure-aggregation "
                         "holds it back")
            return []
        return self._update(model)

    def _meta(self, codec: str) -> UpdateMeta:
        saved = self.saved
        assert saved is not None
        return UpdateMeta(round=saved.round, n_samples=saved.n_samples, base_digest=saved.base_digest,
                          metrics=saved.metrics, codec=codec)

    def _update(self, model: Mapping[str, np.ndarray]) -> list[Action]:
        """The frames of the saved update (a delta codec encodes the difference from the round's `model`)."""
        saved, s = self.saved, self.settings
        assert saved is not None
        base = model if s.compression in DELTA_CODECS else None
        blob = encode_shared(self.manifest, saved.update, s.compression, base)
        blob_id = f"r{saved.round}-{secrets.token_hex(4)}"
        frames = chunk(blob, s.chunk_size, blob_id, self._meta(s.compression).to_dict())
        return [Outgoing(self.topics.update(s.client_id), frame) for frame in frames]

    def _secure_advert(self, info: RoundInfo, model: Mapping[str, np.ndarray]) -> list[Action]:
        """Stage 1 of the session RoundInfo names: fresh keys, once per session (a republished RoundInfo of the
        same session is no reason to start again: the coordinator may be past this stage); none once this device
        revealed shares in the round, or without an identity (the participant says why)."""
        from fedper.secagg import SecAggError  # cryptography: the privacy extra

        saved = self.saved
        assert saved is not None
        current = self._secure
        if current is not None and (current.round, current.session) == (saved.round, info.secagg_session):
            return []
        where = f"round {saved.round}: secure aggregation session {info.secagg_session}"
        if self._make_secure is None:
            self.log(f"{where}: not taking part: this agent runs no secure aggregation")
            return []
        self._secure = self._make_secure(info, saved, model, self._meta(SECAGG_CODEC))  # also if it refuses: once
        try:
            advert = self._secure.advertise()
        except SecAggError as e:
            self.log(f"{where}: not taking part: {e}")
            return []
        self.log(f"{where}: keys advertised")
        return [advert]
