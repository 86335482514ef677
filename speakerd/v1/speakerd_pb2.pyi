from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]

class AudioEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIO_ENCODING_UNSPECIFIED: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_PCM_S16LE: _ClassVar[AudioEncoding]
    AUDIO_ENCODING_PCM_F32LE: _ClassVar[AudioEncoding]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_UINT8: DType
AUDIO_ENCODING_UNSPECIFIED: AudioEncoding
AUDIO_ENCODING_PCM_S16LE: AudioEncoding
AUDIO_ENCODING_PCM_F32LE: AudioEncoding

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("fbank", "waveform", "masks", "request_id")
    FBANK_FIELD_NUMBER: _ClassVar[int]
    WAVEFORM_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    fbank: Tensor
    waveform: Tensor
    masks: Tensor
    request_id: str
    def __init__(self, fbank: _Optional[_Union[Tensor, _Mapping]] = ..., waveform: _Optional[_Union[Tensor, _Mapping]] = ..., masks: _Optional[_Union[Tensor, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "empty", "active_frames", "model_id", "precision", "plans", "request_id", "fp16_fallbacks")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    EMPTY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FP16_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    embeddings: Tensor
    empty: _containers.RepeatedScalarFieldContainer[bool]
    active_frames: _containers.RepeatedScalarFieldContainer[int]
    model_id: str
    precision: str
    plans: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    fp16_fallbacks: int
    def __init__(self, embeddings: _Optional[_Union[Tensor, _Mapping]] = ..., empty: _Optional[_Iterable[bool]] = ..., active_frames: _Optional[_Iterable[int]] = ..., model_id: _Optional[str] = ..., precision: _Optional[str] = ..., plans: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., fp16_fallbacks: _Optional[int] = ...) -> None: ...

class RecordingHeader(_message.Message):
    __slots__ = ("sample_rate", "channels", "encoding", "window_s", "step_s", "exclude_overlap", "request_id", "frames", "segment")
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_OVERLAP_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    sample_rate: int
    channels: int
    encoding: AudioEncoding
    window_s: float
    step_s: float
    exclude_overlap: bool
    request_id: str
    frames: int
    segment: bool
    def __init__(self, sample_rate: _Optional[int] = ..., channels: _Optional[int] = ..., encoding: _Optional[_Union[AudioEncoding, str]] = ..., window_s: _Optional[float] = ..., step_s: _Optional[float] = ..., exclude_overlap: _Optional[bool] = ..., request_id: _Optional[str] = ..., frames: _Optional[int] = ..., segment: _Optional[bool] = ...) -> None: ...

class RecordingMasks(_message.Message):
    __slots__ = ("windows", "masks")
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    windows: int
    masks: Tensor
    def __init__(self, windows: _Optional[int] = ..., masks: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class EmbedRecordingRequest(_message.Message):
    __slots__ = ("header", "audio", "masks")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    header: RecordingHeader
    audio: bytes
    masks: RecordingMasks
    def __init__(self, header: _Optional[_Union[RecordingHeader, _Mapping]] = ..., audio: _Optional[bytes] = ..., masks: _Optional[_Union[RecordingMasks, _Mapping]] = ...) -> None: ...

class EmbedRecordingResponse(_message.Message):
    __slots__ = ("embeddings", "first_window", "starts", "empty", "active_frames", "windows", "model_id", "precision", "request_id", "plans", "fp16_fallbacks", "segmentation", "segmentation_model_id")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    FIRST_WINDOW_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    EMPTY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FRAMES_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    FP16_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTATION_FIELD_NUMBER: _ClassVar[int]
    SEGMENTATION_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    embeddings: Tensor
    first_window: int
    starts: _containers.RepeatedScalarFieldContainer[float]
    empty: _containers.RepeatedScalarFieldContainer[bool]
    active_frames: _containers.RepeatedScalarFieldContainer[int]
    windows: int
    model_id: str
    precision: str
    request_id: str
    plans: _containers.RepeatedScalarFieldContainer[str]
    fp16_fallbacks: int
    segmentation: Tensor
    segmentation_model_id: str
    def __init__(self, embeddings: _Optional[_Union[Tensor, _Mapping]] = ..., first_window: _Optional[int] = ..., starts: _Optional[_Iterable[float]] = ..., empty: _Optional[_Iterable[bool]] = ..., active_frames: _Optional[_Iterable[int]] = ..., windows: _Optional[int] = ..., model_id: _Optional[str] = ..., precision: _Optional[str] = ..., request_id: _Optional[str] = ..., plans: _Optional[_Iterable[str]] = ..., fp16_fallbacks: _Optional[int] = ..., segmentation: _Optional[_Union[Tensor, _Mapping]] = ..., segmentation_model_id: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "engine", "precision", "plan_sizes", "max_batch", "fbank_frames", "mel_bins", "chunk_samples", "max_speakers", "embedding_dim", "mask_frames", "version", "waveform_supported", "max_message_bytes", "source", "segmentation", "plda")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    PLAN_SIZES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    FBANK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MEL_BINS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MAX_SPEAKERS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIM_FIELD_NUMBER: _ClassVar[int]
    MASK_FRAMES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WAVEFORM_SUPPORTED_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTATION_FIELD_NUMBER: _ClassVar[int]
    PLDA_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    engine: str
    precision: str
    plan_sizes: _containers.RepeatedScalarFieldContainer[int]
    max_batch: int
    fbank_frames: int
    mel_bins: int
    chunk_samples: int
    max_speakers: int
    embedding_dim: int
    mask_frames: int
    version: str
    waveform_supported: bool
    max_message_bytes: int
    source: ModelSource
    segmentation: SegmentationModelInfo
    plda: PldaInfo
    def __init__(self, model_id: _Optional[str] = ..., engine: _Optional[str] = ..., precision: _Optional[str] = ..., plan_sizes: _Optional[_Iterable[int]] = ..., max_batch: _Optional[int] = ..., fbank_frames: _Optional[int] = ..., mel_bins: _Optional[int] = ..., chunk_samples: _Optional[int] = ..., max_speakers: _Optional[int] = ..., embedding_dim: _Optional[int] = ..., mask_frames: _Optional[int] = ..., version: _Optional[str] = ..., waveform_supported: _Optional[bool] = ..., max_message_bytes: _Optional[int] = ..., source: _Optional[_Union[ModelSource, _Mapping]] = ..., segmentation: _Optional[_Union[SegmentationModelInfo, _Mapping]] = ..., plda: _Optional[_Union[PldaInfo, _Mapping]] = ...) -> None: ...

class SegmentationModelInfo(_message.Message):
    __slots__ = ("model_id", "engine", "frames", "speakers", "classes", "source")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    SPEAKERS_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    engine: str
    frames: int
    speakers: int
    classes: int
    source: ModelSource
    def __init__(self, model_id: _Optional[str] = ..., engine: _Optional[str] = ..., frames: _Optional[int] = ..., speakers: _Optional[int] = ..., classes: _Optional[int] = ..., source: _Optional[_Union[ModelSource, _Mapping]] = ...) -> None: ...

class PldaInfo(_message.Message):
    __slots__ = ("plda_id", "source", "embedding_dim", "dimension")
    PLDA_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIM_FIELD_NUMBER: _ClassVar[int]
    DIMENSION_FIELD_NUMBER: _ClassVar[int]
    plda_id: str
    source: ModelSource
    embedding_dim: int
    dimension: int
    def __init__(self, plda_id: _Optional[str] = ..., source: _Optional[_Union[ModelSource, _Mapping]] = ..., embedding_dim: _Optional[int] = ..., dimension: _Optional[int] = ...) -> None: ...

class ModelSource(_message.Message):
    __slots__ = ("repo_id", "revision", "filename", "sha256", "synthetic")
    REPO_ID_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    FILENAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SYNTHETIC_FIELD_NUMBER: _ClassVar[int]
    repo_id: str
    revision: str
    filename: str
    sha256: str
    synthetic: bool
    def __init__(self, repo_id: _Optional[str] = ..., revision: _Optional[str] = ..., filename: _Optional[str] = ..., sha256: _Optional[str] = ..., synthetic: _Optional[bool] = ...) -> None: ...

class SpeechSegment(_message.Message):
    __slots__ = ("start_s", "end_s")
    START_S_FIELD_NUMBER: _ClassVar[int]
    END_S_FIELD_NUMBER: _ClassVar[int]
    start_s: float
    end_s: float
    def __init__(self, start_s: _Optional[float] = ..., end_s: _Optional[float] = ...) -> None: ...

class SpeechHeader(_message.Message):
    __slots__ = ("recording", "embeddings", "segments")
    RECORDING_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    recording: RecordingHeader
    embeddings: Tensor
    segments: _containers.RepeatedCompositeFieldContainer[SpeechSegment]
    def __init__(self, recording: _Optional[_Union[RecordingHeader, _Mapping]] = ..., embeddings: _Optional[_Union[Tensor, _Mapping]] = ..., segments: _Optional[_Iterable[_Union[SpeechSegment, _Mapping]]] = ...) -> None: ...

class EnrollHeader(_message.Message):
    __slots__ = ("speaker_id", "speech", "replace")
    SPEAKER_ID_FIELD_NUMBER: _ClassVar[int]
    SPEECH_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    speaker_id: str
    speech: SpeechHeader
    replace: bool
    def __init__(self, speaker_id: _Optional[str] = ..., speech: _Optional[_Union[SpeechHeader, _Mapping]] = ..., replace: _Optional[bool] = ...) -> None: ...

class EnrollRequest(_message.Message):
    __slots__ = ("header", "audio", "masks")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    header: EnrollHeader
    audio: bytes
    masks: RecordingMasks
    def __init__(self, header: _Optional[_Union[EnrollHeader, _Mapping]] = ..., audio: _Optional[bytes] = ..., masks: _Optional[_Union[RecordingMasks, _Mapping]] = ...) -> None: ...

class Voiceprint(_message.Message):
    __slots__ = ("voiceprint_id", "speaker_id", "speech_s", "quality", "windows", "model_id", "created_unix_ms")
    VOICEPRINT_ID_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_ID_FIELD_NUMBER: _ClassVar[int]
    SPEECH_S_FIELD_NUMBER: _ClassVar[int]
    QUALITY_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    voiceprint_id: str
    speaker_id: str
    speech_s: float
    quality: float
    windows: int
    model_id: str
    created_unix_ms: int
    def __init__(self, voiceprint_id: _Optional[str] = ..., speaker_id: _Optional[str] = ..., speech_s: _Optional[float] = ..., quality: _Optional[float] = ..., windows: _Optional[int] = ..., model_id: _Optional[str] = ..., created_unix_ms: _Optional[int] = ...) -> None: ...

class EnrollResponse(_message.Message):
    __slots__ = ("voiceprint", "replaced_voiceprint_id", "request_id")
    VOICEPRINT_FIELD_NUMBER: _ClassVar[int]
    REPLACED_VOICEPRINT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    voiceprint: Voiceprint
    replaced_voiceprint_id: str
    request_id: str
    def __init__(self, voiceprint: _Optional[_Union[Voiceprint, _Mapping]] = ..., replaced_voiceprint_id: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class IdentifyHeader(_message.Message):
    __slots__ = ("speech", "top_k", "threshold")
    SPEECH_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    speech: SpeechHeader
    top_k: int
    threshold: float
    def __init__(self, speech: _Optional[_Union[SpeechHeader, _Mapping]] = ..., top_k: _Optional[int] = ..., threshold: _Optional[float] = ...) -> None: ...

class IdentifyRequest(_message.Message):
    __slots__ = ("header", "audio", "masks")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    header: IdentifyHeader
    audio: bytes
    masks: RecordingMasks
    def __init__(self, header: _Optional[_Union[IdentifyHeader, _Mapping]] = ..., audio: _Optional[bytes] = ..., masks: _Optional[_Union[RecordingMasks, _Mapping]] = ...) -> None: ...

class VoiceprintMatch(_message.Message):
    __slots__ = ("voiceprint_id", "speaker_id", "score")
    VOICEPRINT_ID_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    voiceprint_id: str
    speaker_id: str
    score: float
    def __init__(self, voiceprint_id: _Optional[str] = ..., speaker_id: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class Identification(_message.Message):
    __slots__ = ("matches", "unknown", "speaker_id", "speech_s")
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_ID_FIELD_NUMBER: _ClassVar[int]
    SPEECH_S_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[VoiceprintMatch]
    unknown: bool
    speaker_id: str
    speech_s: float
    def __init__(self, matches: _Optional[_Iterable[_Union[VoiceprintMatch, _Mapping]]] = ..., unknown: _Optional[bool] = ..., speaker_id: _Optional[str] = ..., speech_s: _Optional[float] = ...) -> None: ...

class IdentifyResponse(_message.Message):
    __slots__ = ("rows", "threshold", "model_id", "other_model_voiceprints", "request_id")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    OTHER_MODEL_VOICEPRINTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[Identification]
    threshold: float
    model_id: str
    other_model_voiceprints: int
    request_id: str
    def __init__(self, rows: _Optional[_Iterable[_Union[Identification, _Mapping]]] = ..., threshold: _Optional[float] = ..., model_id: _Optional[str] = ..., other_model_voiceprints: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class VerifyHeader(_message.Message):
    __slots__ = ("voiceprint_id", "speech", "threshold")
    VOICEPRINT_ID_FIELD_NUMBER: _ClassVar[int]
    SPEECH_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    voiceprint_id: str
    speech: SpeechHeader
    threshold: float
    def __init__(self, voiceprint_id: _Optional[str] = ..., speech: _Optional[_Union[SpeechHeader, _Mapping]] = ..., threshold: _Optional[float] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("header", "audio", "masks")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    MASKS_FIELD_NUMBER: _ClassVar[int]
    header: VerifyHeader
    audio: bytes
    masks: RecordingMasks
    def __init__(self, header: _Optional[_Union[VerifyHeader, _Mapping]] = ..., audio: _Optional[bytes] = ..., masks: _Optional[_Union[RecordingMasks, _Mapping]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("score", "accepted", "threshold", "speaker_id", "speech_s", "request_id")
    SCORE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_ID_FIELD_NUMBER: _ClassVar[int]
    SPEECH_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    score: float
    accepted: bool
    threshold: float
    speaker_id: str
    speech_s: float
    request_id: str
    def __init__(self, score: _Optional[float] = ..., accepted: _Optional[bool] = ..., threshold: _Optional[float] = ..., speaker_id: _Optional[str] = ..., speech_s: _Optional[float] = ..., request_id: _Optional[str] = ...) -> None: ...

class ListVoiceprintsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListVoiceprintsResponse(_message.Message):
    __slots__ = ("voiceprints",)
    VOICEPRINTS_FIELD_NUMBER: _ClassVar[int]
    voiceprints: _containers.RepeatedCompositeFieldContainer[Voiceprint]
    def __init__(self, voiceprints: _Optional[_Iterable[_Union[Voiceprint, _Mapping]]] = ...) -> None: ...

class DeleteVoiceprintRequest(_message.Message):
    __slots__ = ("voiceprint_id",)
    VOICEPRINT_ID_FIELD_NUMBER: _ClassVar[int]
    voiceprint_id: str
    def __init__(self, voiceprint_id: _Optional[str] = ...) -> None: ...

class DeleteVoiceprintResponse(_message.Message):
    __slots__ = ("voiceprint_id", "speaker_id")
    VOICEPRINT_ID_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_ID_FIELD_NUMBER: _ClassVar[int]
    voiceprint_id: str
    speaker_id: str
    def __init__(self, voiceprint_id: _Optional[str] = ..., speaker_id: _Optional[str] = ...) -> None: ...

class Clustering(_message.Message):
    __slots__ = ("method", "threshold", "min_cluster_size", "fa", "fb")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MIN_CLUSTER_SIZE_FIELD_NUMBER: _ClassVar[int]
    FA_FIELD_NUMBER: _ClassVar[int]
    FB_FIELD_NUMBER: _ClassVar[int]
    method: str
    threshold: float
    min_cluster_size: int
    fa: float
    fb: float
    def __init__(self, method: _Optional[str] = ..., threshold: _Optional[float] = ..., min_cluster_size: _Optional[int] = ..., fa: _Optional[float] = ..., fb: _Optional[float] = ...) -> None: ...

class DiarizeHeader(_message.Message):
    __slots__ = ("recording", "num_speakers", "min_speakers", "max_speakers", "clustering", "names", "threshold", "uri")
    RECORDING_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEAKERS_FIELD_NUMBER: _ClassVar[int]
    MIN_SPEAKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_SPEAKERS_FIELD_NUMBER: _ClassVar[int]
    CLUSTERING_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    recording: RecordingHeader
    num_speakers: int
    min_speakers: int
    max_speakers: int
    clustering: Clustering
    names: bool
    threshold: float
    uri: str
    def __init__(self, recording: _Optional[_Union[RecordingHeader, _Mapping]] = ..., num_speakers: _Optional[int] = ..., min_speakers: _Optional[int] = ..., max_speakers: _Optional[int] = ..., clustering: _Optional[_Union[Clustering, _Mapping]] = ..., names: _Optional[bool] = ..., threshold: _Optional[float] = ..., uri: _Optional[str] = ...) -> None: ...

class DiarizeRequest(_message.Message):
    __slots__ = ("header", "audio")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    header: DiarizeHeader
    audio: bytes
    def __init__(self, header: _Optional[_Union[DiarizeHeader, _Mapping]] = ..., audio: _Optional[bytes] = ...) -> None: ...

class SpeakerTurn(_message.Message):
    __slots__ = ("start_s", "end_s", "label")
    START_S_FIELD_NUMBER: _ClassVar[int]
    END_S_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    start_s: float
    end_s: float
    label: str
    def __init__(self, start_s: _Optional[float] = ..., end_s: _Optional[float] = ..., label: _Optional[str] = ...) -> None: ...

class DiarizedSpeaker(_message.Message):
    __slots__ = ("label", "cluster", "centroid", "speech_s", "speaker_id", "voiceprint_id", "score")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    CENTROID_FIELD_NUMBER: _ClassVar[int]
    SPEECH_S_FIELD_NUMBER: _ClassVar[int]
    SPEAKER_ID_FIELD_NUMBER: _ClassVar[int]
    VOICEPRINT_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    label: str
    cluster: str
    centroid: Tensor
    speech_s: float
    speaker_id: str
    voiceprint_id: str
    score: float
    def __init__(self, label: _Optional[str] = ..., cluster: _Optional[str] = ..., centroid: _Optional[_Union[Tensor, _Mapping]] = ..., speech_s: _Optional[float] = ..., speaker_id: _Optional[str] = ..., voiceprint_id: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class DiarizeResponse(_message.Message):
    __slots__ = ("turns", "exclusive_turns", "speakers", "rttm", "windows", "model_id", "segmentation_model_id", "request_id", "plda_id")
    TURNS_FIELD_NUMBER: _ClassVar[int]
    EXCLUSIVE_TURNS_FIELD_NUMBER: _ClassVar[int]
    SPEAKERS_FIELD_NUMBER: _ClassVar[int]
    RTTM_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTATION_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PLDA_ID_FIELD_NUMBER: _ClassVar[int]
    turns: _containers.RepeatedCompositeFieldContainer[SpeakerTurn]
    exclusive_turns: _containers.RepeatedCompositeFieldContainer[SpeakerTurn]
    speakers: _containers.RepeatedCompositeFieldContainer[DiarizedSpeaker]
    rttm: str
    windows: int
    model_id: str
    segmentation_model_id: str
    request_id: str
    plda_id: str
    def __init__(self, turns: _Optional[_Iterable[_Union[SpeakerTurn, _Mapping]]] = ..., exclusive_turns: _Optional[_Iterable[_Union[SpeakerTurn, _Mapping]]] = ..., speakers: _Optional[_Iterable[_Union[DiarizedSpeaker, _Mapping]]] = ..., rttm: _Optional[str] = ..., windows: _Optional[int] = ..., model_id: _Optional[str] = ..., segmentation_model_id: _Optional[str] = ..., request_id: _Optional[str] = ..., plda_id: _Optional[str] = ...) -> None: ...

class DiarizeProgress(_message.Message):
    __slots__ = ("stage", "windows_done", "windows", "elapsed_s")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_DONE_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    stage: str
    windows_done: int
    windows: int
    elapsed_s: float
    def __init__(self, stage: _Optional[str] = ..., windows_done: _Optional[int] = ..., windows: _Optional[int] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class DiarizeEvent(_message.Message):
    __slots__ = ("progress", "result")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    progress: DiarizeProgress
    result: DiarizeResponse
    def __init__(self, progress: _Optional[_Union[DiarizeProgress, _Mapping]] = ..., result: _Optional[_Union[DiarizeResponse, _Mapping]] = ...) -> None: ...
