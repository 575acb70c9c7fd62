"""The API-neutral service: admission -> first output -> answer, read by one OutputReader and streamed by one body."""
