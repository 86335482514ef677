"""Dynamic batching: concurrent requests' chunks packed into engine batches, the queue's state as
plain data, and the threads that run the batches."""
