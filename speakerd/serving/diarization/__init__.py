"""Diarization (docs/diarization.md): `Diarize`, a recording in, who spoke when (and, from the
caller's voiceprints, by name) out. One module: service (the gRPC method over the recording
path and speakerd.model.diarization)."""
