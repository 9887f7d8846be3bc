"""The loader a trainer imports: `SampleReader` (tokpack.loader.reader) over runs, epochs and,
through its table of readers by manifest kind, node slices (tokpack.loader.slice_reader), and
`TokpackDataset` (tokpack.loader.torch_adapter), the only module that imports torch. Imports
only tokpack.formats."""
