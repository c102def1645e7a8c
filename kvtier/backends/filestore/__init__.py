"""The on-disk scheme shared by the file and io_uring backends: paths, publishing, index.

This package holds no code of its own; each module does one job:

* :mod:`~kvtier.backends.filestore.options`: :class:`FileStoreOptions` (the options every
  backend on this scheme takes), the default root, the config-time O_DIRECT check;
* :mod:`~kvtier.backends.filestore.paths`: where pages and temp files live (key checks,
  sharded page paths, modes, temp file names) and creating a fresh temp file;
* :mod:`~kvtier.backends.filestore.writes`: moving bytes to disk (``pwritev`` loops,
  ``fsync`` of directories, temp file clean-up) and the O_DIRECT alignment and
  filesystem checks;
* :mod:`~kvtier.backends.filestore.publish`: the publish protocol, described once, and
  its steps (the temp-name check, the ``renameat2`` exchange or rename, the check after
  it, dropping the replaced file), which every loop that writes pages follows: in C
  where ``_pageio`` is built, in Python as the fallback;
* :mod:`~kvtier.backends.filestore.startup`: opening a store (private directories) and
  :func:`~kvtier.backends.filestore.startup.sweep_store`, the one walk over a store
  (start-up, ``rescan``, ``clear``) that finds the pages and deals with debris;
* :mod:`~kvtier.backends.filestore.debris`: what debris is (its kinds and counters), and
  removing it without following a symlink;
* :mod:`~kvtier.backends.filestore.index`: :class:`FileIndex`, the in-memory index
  with capacity (evicting through the context's policy, LRU by default) and the
  free-space guard;
* :mod:`~kvtier.backends.filestore.store`: :class:`FileStore`, one opened store, which
  both backends hold: counters, opening pages for reading, temp files and publishing
  over debris, ``delete`` / ``clear`` / ``rescan`` / ``stats``;
* :mod:`~kvtier.backends.filestore.base`: :class:`FileStoreBackend`, the shell both
  backends are built on (the contract, the closed check, the spares and slice threads,
  the dispatch between the compiled loop and the backend's own loop);
* :mod:`~kvtier.backends.filestore.slices`: one slice of a batch per thread;
* :mod:`~kvtier.backends.filestore.extension`: loading the compiled module ``_pageio``
  (built from ``_pageio_src/``, one C file a job), or why it is not used;
* :mod:`~kvtier.backends.filestore.compiled`: the compiled per-page loop and what its
  codes mean.

Layout of a store (``paths.store_dir(root, namespace)``)::

    <root>/                          created 0700; refused if owned by another user or
                                     readable / writable by group or others
      <namespace>/                   one store per BackendContext.namespace (``clear`` scope)
        <aa>/<bb>/<key>.kv           one file per page, 0600; ``aa``/``bb`` are the first
                                     four hex digits of blake2b(key), 65536 leaf dirs at most
        <aa>/<bb>/.<pid>.<tid>.<n>.tmp   a page being written by process ``pid``, thread
                                     ``tid``; never read, published by rename(2)

A page file holds the concatenation of the page's regions (envelope header, then payload)
and nothing else, so its size is the page's stored size and a reader needs no framing.

Publishing is ``write temp -> (fsync) -> rename(temp, final)`` in the same directory (the
steps in full: :mod:`~kvtier.backends.filestore.publish`), so a reader that opens
``<key>.kv`` sees a whole old page, a whole new page, or no file: never a torn one, even
when the writer is killed mid-write (its temp file is left behind and removed at the next
start-up) or the disk fills (the writer removes its temp file).
Concurrent puts of one key from several threads or processes each write their own temp
file; the last rename wins and the page is whole either way.

Durability modes: ``none`` (no fsync: the page survives a process crash, not a power
cut), ``page`` (fsync each page file before its rename and its directory after), ``batch``
(fsync each page file, then rename the batch and fsync each touched directory once).

The index (key -> size) is rebuilt at start-up by scanning the store, with modification
times giving the initial order of use; afterwards it is maintained in memory, so
``exists`` costs a dict lookup. It serves eviction under ``capacity_bytes`` and the
minimum-free-space guard (``os.statvfs``): before a page is written, the pages the
eviction policy chooses (``BackendContext.eviction``; least recently used first when
none is given) are evicted until both hold, or the put fails. Every page's arrival,
read and removal is recorded in that policy. Several processes may share a store;
each keeps its own index. A key missing from this process's index is looked up on disk
(one ``stat``) and adopted when another process wrote it; a key another process removed is
dropped from the index when a read finds no file. Capacity is therefore enforced per
process over the pages it knows of; the free-space guard sees the whole filesystem.

A backend built on this scheme (file, io_uring) subclasses :class:`FileStoreBackend`, which
opens ``fs = FileStore(config, namespace, name, log)`` at start-up (0700 dirs, the debris
sweep, the index); its own loop then does, per page::

    final = paths.page_path(fs.path, key)         # validates the key
    reason = fs.index.reserve(key, nbytes)        # evicts (LRU) pages; None when it fits
    fd, tmp = fs.open_temp(final, o_direct=...)   # 0600, O_EXCL, shard dirs made 0700
    ...write every region at its offset...; fsync(fd) unless durability == "none"
    written = publish.file_id(fd); os.close(fd)
    fs.publish_page(key, tmp, final, nbytes, written=written)  # the protocol; commits
    # on any failure before publishing: writes.unlink_quietly([tmp]);
    # fs.index.release(nbytes); report False

and reads with ``fd = fs.open_page(key, path, nbytes)`` (None: a counted miss).

Debris (anything in the store that is not a page, a shard directory or a live writer's
temp file) never stops a store from opening: the sweep removes it or resets its mode,
logs each thing once and counts it in ``stats()["debris_<kind>"]``
(:data:`~kvtier.backends.filestore.debris.KINDS`); a put, get or delete that meets debris
under a name it needs removes it the same way. Symlinks are removed, never followed.

Keys reach the filesystem only after ``paths.check_key`` (the key module's
``validate_key``: lowercase ASCII letters, digits, ``_`` and ``-``, starting with a letter
or digit, at most 160 characters), so no key can name a path outside the store or collide
with a temp file (those start with ``.``).
"""
