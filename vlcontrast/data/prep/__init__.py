"""Data preparation: turn a source of images and captions into training shards.

Every converter writes the same layout, the one the loader, the check and evaluation read:
webdataset shards named ``00000.tar ...`` with img2dataset-style keys, plus ``sizes.json`` and
``manifest.json`` beside them (``vlcontrast.data.shards``).

=============  ====================================================================================
``folder``     ``prep folder``: a folder of images, any nesting (captions from ``.txt``/``.json``
               sidecars, from class folders and templates, or from cleaned file names) -> shards
``table``      ``prep csv``: a CSV/TSV of image paths or URLs + captions (open_clip's convention);
               URL rows go through ``cc3m``'s img2dataset path
``wds``        ``prep wds``: re-key any webdataset (dense numeric ids, the original key kept in
               ``.json``, the caption member chosen) for losses that need sample ids
``writer``     the shard writer ``folder``, ``table`` and ``wds`` share: parallel over shards,
               progress, resumable, skipped inputs counted by reason; ``encode_image``
``synthetic``  the procedural image-caption world of the demo, tests and study
``cc3m``       a URL list (CC3M's TSV, or any ``caption<TAB>url`` lines) -> shards via img2dataset
=============  ====================================================================================

User documentation: ``docs/data.md``.
"""
