"""The gRPC front end: the SpeakerEmbedding service's methods, request decoding and validation,
how a failed call is answered, and the HTTP/2 settings of every process that accepts calls."""
