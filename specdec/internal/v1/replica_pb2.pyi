from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "penalty_start", "logit_bias", "banned_ids", "banned_until")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_START_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    BANNED_IDS_FIELD_NUMBER: _ClassVar[int]
    BANNED_UNTIL_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    penalty_start: int
    logit_bias: _containers.ScalarMap[int, float]
    banned_ids: _containers.RepeatedScalarFieldContainer[int]
    banned_until: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., penalty_start: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., banned_ids: _Optional[_Iterable[int]] = ..., banned_until: _Optional[int] = ...) -> None: ...

class DraftDistributions(_message.Message):
    __slots__ = ("vocab_size", "sparse", "dense_fp16", "sparse_ids_int32", "sparse_probs_fp16", "row_lengths")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    DENSE_FP16_FIELD_NUMBER: _ClassVar[int]
    SPARSE_IDS_INT32_FIELD_NUMBER: _ClassVar[int]
    SPARSE_PROBS_FP16_FIELD_NUMBER: _ClassVar[int]
    ROW_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    sparse: bool
    dense_fp16: bytes
    sparse_ids_int32: bytes
    sparse_probs_fp16: bytes
    row_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, vocab_size: _Optional[int] = ..., sparse: _Optional[bool] = ..., dense_fp16: _Optional[bytes] = ..., sparse_ids_int32: _Optional[bytes] = ..., sparse_probs_fp16: _Optional[bytes] = ..., row_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class CacheRef(_message.Message):
    __slots__ = ("session_id", "epoch", "start", "tokens", "resync")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    resync: bool
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., resync: _Optional[bool] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("cache", "num_tokens", "sampling", "guess_bonus", "stop_below", "runner_ups", "fork")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GUESS_BONUS_FIELD_NUMBER: _ClassVar[int]
    STOP_BELOW_FIELD_NUMBER: _ClassVar[int]
    RUNNER_UPS_FIELD_NUMBER: _ClassVar[int]
    FORK_FIELD_NUMBER: _ClassVar[int]
    cache: CacheRef
    num_tokens: int
    sampling: SamplingParams
    guess_bonus: bool
    stop_below: float
    runner_ups: bool
    fork: bool
    def __init__(self, cache: _Optional[_Union[CacheRef, _Mapping]] = ..., num_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., guess_bonus: _Optional[bool] = ..., stop_below: _Optional[float] = ..., runner_ups: _Optional[bool] = ..., fork: _Optional[bool] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("draft_tokens", "distributions", "cache_length", "compute_ms", "batch_size", "runner_ups")
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNER_UPS_FIELD_NUMBER: _ClassVar[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    distributions: DraftDistributions
    cache_length: int
    compute_ms: float
    batch_size: int
    runner_ups: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, draft_tokens: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Union[DraftDistributions, _Mapping]] = ..., cache_length: _Optional[int] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., runner_ups: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("cache", "draft_tokens", "distributions", "sampling", "logprobs", "top_logprobs", "fed_logprobs", "processed_logprobs")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROCESSED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    cache: CacheRef
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    distributions: DraftDistributions
    sampling: SamplingParams
    logprobs: bool
    top_logprobs: int
    fed_logprobs: bool
    processed_logprobs: bool
    def __init__(self, cache: _Optional[_Union[CacheRef, _Mapping]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Union[DraftDistributions, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., fed_logprobs: _Optional[bool] = ..., processed_logprobs: _Optional[bool] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted", "next_token", "cache_length", "compute_ms", "batch_size", "resynced", "batch_tokens", "keep_chances", "logprobs", "top_token_ids", "top_logprobs", "fed_logprobs", "fed_top_token_ids", "fed_top_logprobs", "min_p", "processed_logprobs", "shaped")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESYNCED_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEEP_CHANCES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FED_TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FED_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PROCESSED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SHAPED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    next_token: int
    cache_length: int
    compute_ms: float
    batch_size: int
    resynced: bool
    batch_tokens: int
    keep_chances: _containers.RepeatedScalarFieldContainer[float]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    fed_logprobs: _containers.RepeatedScalarFieldContainer[float]
    fed_top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    fed_top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    min_p: float
    processed_logprobs: bool
    shaped: bool
    def __init__(self, accepted: _Optional[int] = ..., next_token: _Optional[int] = ..., cache_length: _Optional[int] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., resynced: _Optional[bool] = ..., batch_tokens: _Optional[int] = ..., keep_chances: _Optional[_Iterable[float]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., fed_logprobs: _Optional[_Iterable[float]] = ..., fed_top_token_ids: _Optional[_Iterable[int]] = ..., fed_top_logprobs: _Optional[_Iterable[float]] = ..., min_p: _Optional[float] = ..., processed_logprobs: _Optional[bool] = ..., shaped: _Optional[bool] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("pool", "address", "sessions", "cache_bytes", "queue_length", "max_sessions", "prefill_tokens", "forward_passes", "evictions", "model", "vocab_size")
    POOL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    pool: str
    address: str
    sessions: int
    cache_bytes: int
    queue_length: int
    max_sessions: int
    prefill_tokens: int
    forward_passes: int
    evictions: int
    model: str
    vocab_size: int
    def __init__(self, pool: _Optional[str] = ..., address: _Optional[str] = ..., sessions: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., queue_length: _Optional[int] = ..., max_sessions: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., forward_passes: _Optional[int] = ..., evictions: _Optional[int] = ..., model: _Optional[str] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class ProposeCall(_message.Message):
    __slots__ = ("id", "request", "cancel")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    id: int
    request: ProposeRequest
    cancel: bool
    def __init__(self, id: _Optional[int] = ..., request: _Optional[_Union[ProposeRequest, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class ProposeCalls(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[ProposeCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[ProposeCall, _Mapping]]] = ...) -> None: ...

class ProposeAnswer(_message.Message):
    __slots__ = ("id", "response", "code", "details")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    id: int
    response: ProposeResponse
    code: int
    details: str
    def __init__(self, id: _Optional[int] = ..., response: _Optional[_Union[ProposeResponse, _Mapping]] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class ProposeAnswers(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[ProposeAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[ProposeAnswer, _Mapping]]] = ...) -> None: ...

class VerifyCall(_message.Message):
    __slots__ = ("id", "request", "cancel")
    ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    id: int
    request: VerifyRequest
    cancel: bool
    def __init__(self, id: _Optional[int] = ..., request: _Optional[_Union[VerifyRequest, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class VerifyCalls(_message.Message):
    __slots__ = ("calls",)
    CALLS_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[VerifyCall]
    def __init__(self, calls: _Optional[_Iterable[_Union[VerifyCall, _Mapping]]] = ...) -> None: ...

class VerifyAnswer(_message.Message):
    __slots__ = ("id", "response", "code", "details")
    ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    id: int
    response: VerifyResponse
    code: int
    details: str
    def __init__(self, id: _Optional[int] = ..., response: _Optional[_Union[VerifyResponse, _Mapping]] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class VerifyAnswers(_message.Message):
    __slots__ = ("answers",)
    ANSWERS_FIELD_NUMBER: _ClassVar[int]
    answers: _containers.RepeatedCompositeFieldContainer[VerifyAnswer]
    def __init__(self, answers: _Optional[_Iterable[_Union[VerifyAnswer, _Mapping]]] = ...) -> None: ...
