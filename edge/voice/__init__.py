"""``edge voice``: a spoken front-end for the service.

The pipeline, one process beside ``edge serve`` (see docs/voice.md)::

    audio in (mic / WAV / PCM) -> 16 kHz frames -> Silero VAD -> end of utterance
        -> ASR (pocketsphinx | faster-whisper), partial transcripts prefilled (max_tokens 0)
        -> streamed chat request (the ``edge chat`` client) -> phrases -> TTS (espeak-ng | Piper)
        -> audio out (speaker / WAV timeline), with barge-in: speech during an answer stops
           the audio and cancels the request.

Modules: ``audio_io`` (sources, resampling, WAV), ``vad``, ``asr``, ``tts``, ``phrases``
(cutting and truncating text), ``player`` (playback clock, what was spoken), ``turns``
(one exchange and its timings), ``session`` (the threads that join them), ``cli``.
Every engine is imported lazily: ``import edge.voice`` needs none of them.
"""
