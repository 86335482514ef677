"""pyannote/segmentation-3.0 (PyanNet) in NumPy: the network as data, its weights, its forward.

The second network speakerd serves (docs/segmentation.md): 10 s windows of 16 kHz audio in,
589 frames of powerset log-probabilities out, the same math as pyannote.audio 4.0.7's own
`PyanNet` on the same checkpoint. Like the rest of `speakerd.model`, NumPy only.
"""
