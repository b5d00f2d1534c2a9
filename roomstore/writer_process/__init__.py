"""The store's writer in a child process (``StoreConfig.writer_process``),
both halves: ``parent`` (``WriterProcess``, which ``RoomStore`` uses to
forward its writes) and ``child`` (the process it starts, ``python -m
roomstore.writer_process.child``, which opens the store as the writer).
The parent's module describes the frames they exchange."""
