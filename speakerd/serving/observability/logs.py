"""The log line format every process of a server writes (the server, its receivers and
device workers), so their lines interleave readably in one log."""

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
