"""The errors a user's input causes, in one place: the commands print them as one line and exit 2.

Not an article section. Raised across infra/ and by the commands; train.py and evaluate.py catch
USER_ERRORS (a traceback is for the project's own bugs, not for a typo in a flag or a file).
"""


class InputError(ValueError):
    """Bad input to a run (a data file, model, reward or checkpoint):
    reported as one line, exit code 2."""


class CheckpointError(ValueError):
    """A checkpoint or run log that is missing or cannot be read: train.py prints it in one line."""


class FolderInUse(ValueError):
    """Another live run holds the output folder: train.py prints the message in one line."""


class ShardingError(ValueError):
    """--fsdp cannot shard this model with this torch: train.py prints the message in one line."""


USER_ERRORS = (InputError, CheckpointError, FolderInUse, ShardingError)  # one line, exit 2
