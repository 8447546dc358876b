# conversation: a multi-turn chat through kvshare-serve --device hybrid (issue #23): later
# turns hand over only what the decoder's slot lacks, or are forwarded; replies and KV equal
# the decoder alone's. The reference pair always; the patched llama-server with
# LLAMA_SERVER_KVSHARE=path.
add_test(NAME conversation
         COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_SOURCE_DIR}/conversation.py ${CMAKE_BINARY_DIR}/bin)
set_tests_properties(conversation PROPERTIES TIMEOUT 900 SKIP_RETURN_CODE 77)
