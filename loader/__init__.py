"""The loader a trainer imports: `SampleReader` (tokpack.loader.reader) over runs, epochs and,
through its table of readers by manifest kind, node slices (tokpack.loader.slice_reader), and
`TokpackDataset` (tokpack.loader.torch_adapter) and the trainers' forms of its batch
(tokpack.loader.trainer_forms), the only modules that import torch. Imports
only tokpack.formats."""
