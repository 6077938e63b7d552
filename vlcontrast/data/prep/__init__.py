"""Data preparation: turn a source of images and captions into training shards.

Every converter writes the same layout, the one the loader, the check and evaluation read:
webdataset shards named ``00000.tar ...`` with img2dataset-style keys, plus ``sizes.json`` and
``manifest.json`` beside them (``vlcontrast.data.shards``).

=============  ====================================================================================
``synthetic``  the procedural image-caption world of the demo, tests and study
``cc3m``       a URL list (CC3M's TSV, or any list of URL + caption) -> shards through img2dataset
=============  ====================================================================================

User documentation: ``docs/data.md``.
"""
