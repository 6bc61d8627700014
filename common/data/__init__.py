"""Data set files and what turns them into client data: the readers for real formats (cifar,
leaf, datasets), partitions across clients (partition), the files a run needs (datafiles), small
files in those formats for tests (fakedata); models: the old name of common/models/, re-exported."""
