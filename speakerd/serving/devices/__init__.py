"""`serve --devices`: one worker process per device behind the batcher, fed through shared-memory
slots, and which device takes the next batch."""
